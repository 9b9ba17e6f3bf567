"""Server mode: the pool's Redis, the reaper, and (with the wire protocol) the client listener."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from daemon import reaper
from daemon.config import Config
from daemon.queue import JobQueue
from daemon.redis_client import PoolRedis

log = logging.getLogger(__name__)


class PoolServer:
    """`start()` brings the pool up; `stop()` takes it down in reverse order and is safe to call twice."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.redis = PoolRedis(config)
        self.queue: JobQueue | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        client = await self.redis.start()
        c = self.config
        self.queue = JobQueue(
            client, lease_seconds=c.worker_healthy_response_period, retention_seconds=int(c.job_retention)
        )
        interval = min(c.worker_healthy_response_period / 4, 5.0)
        self._spawn(reaper.run(self.queue, interval), "reaper")
        where = "embedded, data in " + str(c.data_path()) if self.redis.embedded else c.worker_mode
        log.info("gpupool server ready: Redis on %s (%s)", self.redis.address, where)

    def _spawn(self, coro: object, name: str) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro, name=name)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.redis.stop()
        log.info("gpupool server stopped")
