"""One real pool for a test module of the Python API: a server with an S3 store and a worker, on
their own event loop in a thread of their own, so that the API's blocking calls (which the tests
make, as a notebook would) never block the loop that serves them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from daemon.queue.embedded_redis import EmbeddedRedis
from tests.support.pool import fresh_bucket, running_pool
from tests.support.s3server import S3Server
from tests.support.workers import running_worker

START_SECONDS = 60.0


@dataclass(frozen=True)
class ApiPool:
    address: str
    tokens: dict[str, str]
    home: Path

    def env(self, user: str = "alice") -> dict[str, str]:
        """The environment of a process that reaches this pool as `user` (gpupool.connect()
        with no arguments, as poolctl)."""
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "XDG_CONFIG_HOME": str(self.home / "xdg"),
            "XDG_CACHE_HOME": str(self.home / "cache"),
            "GPUPOOL_SERVER": self.address,
            "GPUPOOL_USER": user,
            "GPUPOOL_TOKEN": self.tokens[user],
        }


def job_env() -> dict[str, str]:
    """The worker's environment: `python` on its PATH is this one (as a project's environment's
    would be, not a shim that starts a shell first)."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}


@pytest.fixture(scope="module")
def api_pool(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[ApiPool]:
    tmp = tmp_path_factory.mktemp("api")
    redis = EmbeddedRedis(tmp / "redis", appendfsync="always")
    redis.start()
    ready: concurrent.futures.Future[tuple[ApiPool, asyncio.AbstractEventLoop, asyncio.Event]] = (
        concurrent.futures.Future()
    )

    async def serve() -> None:
        store = await fresh_bucket(s3_server)
        async with (
            running_pool(redis, tmp, store=store) as pool,
            running_worker(pool.queue, tmp / "w", store=pool.server.store, slots=8, env=job_env()),
        ):
            stop = asyncio.Event()
            (tmp / "home").mkdir()
            ready.set_result(
                (ApiPool(pool.address, pool.tokens, tmp / "home"), asyncio.get_running_loop(), stop)
            )
            await stop.wait()

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    thread = threading.Thread(target=run, name="api-pool", daemon=True)
    thread.start()
    try:
        pool, loop, stop = ready.result(START_SECONDS)
        yield pool
        loop.call_soon_threadsafe(stop.set)
        thread.join(START_SECONDS)
    finally:
        redis.stop()


@pytest.fixture
def as_alice(api_pool: ApiPool, monkeypatch: pytest.MonkeyPatch) -> ApiPool:
    """This process reaches the module's pool as alice (GPUPOOL_* in its environment)."""
    for name, value in api_pool.env("alice").items():
        if name != "PATH":
            monkeypatch.setenv(name, value)
    return api_pool
