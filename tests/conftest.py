"""Fixtures: real servers on free loopback ports, never fakes (docs/DESIGN.md §10).

- `redis_server`: a fresh redis-server per test (it starts in ~20 ms), launched by the same code as
  the embedded default, with `appendfsync always`; `redis_server.kill()` + `.start()` is a crash and
  restart on the same AOF.
- `s3_server`: a SeaweedFS S3 endpoint (`weed mini`) per session, with static credentials.
- `sentinel_group`: a primary, a replica and three sentinels (tests/support/sentinel.py), each a
  redis-server process of the same binary; `kill(primary())` is the primary machine's death.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import secrets
import sys
import threading
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import uvloop
from redis.asyncio import Redis

from daemon.aio import cancel_and_wait
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.worker.spawn import Spawner
from storage.s3 import S3Store
from tests.support.cluster import ClusterGroup, ClusterServer
from tests.support.pool import Pool, running_pool
from tests.support.s3server import S3Server, shared_s3
from tests.support.sentinel import SentinelGroup

# Every server a test starts, in this process or as a poold of its own, serves its dashboard on a
# free port, not the fixed default one (two at once would collide, as the metrics port would).
os.environ.setdefault("GPUPOOL_WEB_LISTEN", "127.0.0.1:0")


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], Any]]:
    # uvloop is what poold runs on; test on it too. Process spawning does not depend on the loop:
    # its tests run on both.
    if getattr(getattr(item, "module", None), "__name__", "").endswith("test_spawn"):
        return {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}
    return {"uvloop": uvloop.new_event_loop}


# -- no test may hang the suite --------------------------------------------------------------------
# pytest-timeout fails a test that runs too long, but a failure can still hang in its teardown: a
# test that fails half-way may leave servers or sockets open, and uvloop's loop.close() then waits
# in uv_run for ever (a `make test` once sat there until CI's limit). Two bounds, so that cannot be:
# `_nothing_left_running` cancels, within a bound, the tasks a test left behind; and the watchdog
# below ends the whole run, with every thread's stack, if one test, teardown included, outlives
# its timeout by TEARDOWN_GRACE.

TEARDOWN_GRACE = float(os.environ.get("GPUPOOL_TEST_TEARDOWN_GRACE", "60"))
LEFTOVER_TASKS_SECONDS = 10.0


def _timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(item.config.getini("timeout") or 120)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    limit = _timeout_of(item) + TEARDOWN_GRACE
    done = threading.Event()

    def watch() -> None:
        if done.wait(limit):
            return
        capture = item.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.suspend_global_capture(in_=True)  # what follows must reach the real stderr
        sys.stderr.write(
            f"\n{item.nodeid} has not ended {limit:g} s after it began (teardown included): stopping\n"
        )
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(3)

    threading.Thread(target=watch, name="test watchdog", daemon=True).start()
    try:
        yield
    finally:
        done.set()


@pytest.fixture(autouse=True)
async def _nothing_left_running() -> AsyncIterator[None]:
    """After each test: cancel, within a bound, every task it left running (a failed test's
    servers, readers, loops), so that closing its event loop cannot wait on them."""
    yield
    current = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    if left:
        try:
            async with asyncio.timeout(LEFTOVER_TASKS_SECONDS):
                await asyncio.gather(*(cancel_and_wait(t) for t in left), return_exceptions=True)
        except TimeoutError:
            names = ", ".join(t.get_name() for t in left if not t.done())
            pytest.fail(
                f"tasks still running {LEFTOVER_TASKS_SECONDS:g} s after they were cancelled: {names}"
            )


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path / "data", appendfsync="always")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def sentinel_group(tmp_path: Path) -> Iterator[SentinelGroup]:
    """A primary, one replica, three sentinels."""
    with SentinelGroup(tmp_path / "sentinel") as group:
        yield group


@pytest.fixture
def sentinel_group_of_three(tmp_path: Path) -> Iterator[SentinelGroup]:
    """A primary and two replicas: after a failover the new primary still has a replica, so
    writes that must reach one (redis_min_replicas_ack = 1) still can."""
    with SentinelGroup(tmp_path / "sentinel3", replicas=2) as group:
        yield group


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterGroup]:
    """Three primaries on loopback, for the whole session (tests/support/cluster.py)."""
    with ClusterGroup(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture
def cluster_server(redis_cluster: ClusterGroup) -> ClusterServer:
    """The session's cluster, emptied, as a server tests make clients of."""
    server = ClusterServer(redis_cluster)
    server.flush()
    return server


@pytest.fixture
async def redis(redis_server: EmbeddedRedis) -> AsyncIterator[Redis]:
    client = redis_server.client()
    yield client
    await client.aclose()


@pytest.fixture
async def spawner() -> AsyncIterator[Spawner]:
    """A worker's job spawner (daemon/worker/spawn.py), as the worker's own user."""
    spawner = Spawner()
    try:
        yield spawner
    finally:
        await spawner.close()


@pytest.fixture
def fast_path() -> bool:
    """The GPU-less fast path's switch for the test's queues (daemon/queue/fast_path.py): on, as
    by default; tests marked `both_paths` run with it off too (tests/daemon/worker/conftest.py)."""
    return True


@pytest.fixture
async def queue(redis: Redis, fast_path: bool) -> JobQueue:
    return JobQueue(redis, lease_seconds=30, fast_path=fast_path)


@pytest.fixture(scope="session")
def s3_server() -> S3Server:
    """The process's S3 endpoint (tests/support/s3server.py), which the pools of the tests share."""
    return shared_s3()


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
