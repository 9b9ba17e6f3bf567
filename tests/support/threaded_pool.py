"""A real pool (a server with an S3 store, and a worker) on an event loop of its own, in a thread,
for tests of the Python API (`import gpupool`) and what is built on it: the API's blocking calls,
made by the test as a notebook makes them, must never block the loop that serves them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from daemon.queue.embedded_redis import EmbeddedRedis
from tests.support.pool import fresh_bucket, running_pool
from tests.support.s3server import S3Server
from tests.support.workers import running_worker

START_SECONDS = 60.0


@dataclass(frozen=True)
class ThreadedPool:
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


@contextmanager
def threaded_pool(tmp: Path, s3_server: S3Server, slots: int = 8) -> Iterator[ThreadedPool]:
    """A pool with users alice and bob, its worker running `slots` jobs at once, until the end
    of the block."""
    redis = EmbeddedRedis(tmp / "redis", appendfsync="always")
    redis.start()
    started: concurrent.futures.Future[tuple[ThreadedPool, asyncio.AbstractEventLoop, asyncio.Event]] = (
        concurrent.futures.Future()
    )

    async def serve() -> None:
        store = await fresh_bucket(s3_server)
        async with (
            running_pool(redis, tmp, store=store) as pool,
            running_worker(pool.queue, tmp / "w", store=pool.server.store, slots=slots, env=job_env()),
        ):
            stop = asyncio.Event()
            (tmp / "home").mkdir()
            started.set_result(
                (ThreadedPool(pool.address, pool.tokens, tmp / "home"), asyncio.get_running_loop(), stop)
            )
            await stop.wait()

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)
            raise

    thread = threading.Thread(target=run, name="threaded-pool", daemon=True)
    thread.start()
    try:
        pool, loop, stop = started.result(START_SECONDS)
        try:
            yield pool
        finally:
            loop.call_soon_threadsafe(stop.set)
            thread.join(START_SECONDS)
    finally:
        redis.stop()
