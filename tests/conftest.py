"""Fixtures: real servers on free loopback ports, never fakes (DESIGN.md §10).

- `redis_server`: a fresh redis-server per test (it starts in ~20 ms), launched by the same code as
  the embedded default, with `appendfsync always`; `redis_server.kill()` + `.start()` is a crash and
  restart on the same AOF.
- `s3_server`: a SeaweedFS S3 endpoint (`weed mini`) per session, with static credentials.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import uvloop
from redis.asyncio import Redis

from daemon.embedded_redis import EmbeddedRedis
from daemon.queue import JobQueue
from tests.pool import Pool, running_pool
from tests.s3server import S3Server


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], Any]]:
    # uvloop is what poold runs on; test on it too.
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path / "data", appendfsync="always")
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def redis(redis_server: EmbeddedRedis) -> AsyncIterator[Redis]:
    client = redis_server.client()
    yield client
    await client.aclose()


@pytest.fixture
async def queue(redis: Redis) -> JobQueue:
    return JobQueue(redis, lease_seconds=30)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def pool(redis_server: EmbeddedRedis, tmp_path: Path) -> AsyncIterator[Pool]:
    async with running_pool(redis_server, tmp_path) as p:
        yield p
