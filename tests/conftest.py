"""Fixtures: real servers on free loopback ports, never fakes (DESIGN.md §10).

- `redis_server`: a fresh redis-server per test (it starts in ~20 ms), launched by the same code as
  the embedded default, with `appendfsync always`; `redis_server.kill()` + `.start()` is a crash and
  restart on the same AOF.
- `s3_server`: a SeaweedFS S3 endpoint (`weed mini`) per session, with static credentials.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import uvloop
from redis.asyncio import Redis

from daemon.embedded_redis import EmbeddedRedis
from daemon.queue import JobQueue
from storage.s3 import S3Store
from tests.pool import Pool, running_pool
from tests.s3server import S3Server


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], Any]]:
    # uvloop is what poold runs on; test on it too. Process spawning does not depend on the loop:
    # its tests run on both.
    if getattr(getattr(item, "module", None), "__name__", "").endswith("test_spawn"):
        return {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}
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
async def s3_env(s3_server: S3Server) -> dict[str, str]:
    """GPUPOOL_* variables pointing a multinode `poold` at a fresh bucket of the session's S3
    endpoint: a worker refuses to start without its bucket."""
    bucket = f"w-{secrets.token_hex(6)}"
    address = s3_server.endpoint.removeprefix("http://")
    async with S3Store(address, bucket, s3_server.access_key, s3_server.secret_key) as store:
        await store.ensure_bucket()
    return {
        "GPUPOOL_MAIN_SERVER_MINIO_ADDRESS": address,
        "GPUPOOL_MAIN_SERVER_MINIO_BUCKET": bucket,
        "GPUPOOL_MAIN_SERVER_MINIO_ACCESS_KEY_ID": s3_server.access_key,
        "GPUPOOL_MAIN_SERVER_MINIO_SECRET_ACCESS_KEY": s3_server.secret_key,
    }


@pytest.fixture
async def pool(redis_server: EmbeddedRedis, tmp_path: Path) -> AsyncIterator[Pool]:
    async with running_pool(redis_server, tmp_path) as p:
        yield p
