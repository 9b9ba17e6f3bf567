"""Worker mode as a daemon (`poold --worker`): the pool's Redis, the object store, one Worker, its
metrics endpoint, readiness and the systemd watchdog."""

from __future__ import annotations

from daemon import sd_notify
from daemon.aio import TaskSet, start_or_undo
from daemon.config import Config
from daemon.errors import GpupoolError
from daemon.metrics.endpoint import MetricsServer, serve_for
from daemon.object_store import open_worker_store
from daemon.queue.job_queue import JobQueue
from daemon.queue.pool_redis import PoolRedis
from daemon.worker.dispatcher import Worker
from storage.base import ObjectStore


class WorkerDaemon:
    """Worker mode (`poold --worker`): the pool's Redis, the object store, a Worker, its metrics,
    readiness and watchdog. `main` drives it like the server: `start()`, then on the first signal
    `stop()` (drain), on a second `force()` (stop jobs now; attempts are still handed back)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.redis = PoolRedis(config)
        self.worker: Worker | None = None
        self.store: ObjectStore | None = None
        self.metrics_server: MetricsServer | None = None
        self._tasks = TaskSet()

    async def start(self) -> None:
        """Start everything; a failed start stops what did start (aio.start_or_undo)."""
        await start_or_undo(self._start, self.stop)

    async def _start(self) -> None:
        c = self.config
        if c.embedded:
            raise GpupoolError(
                "worker mode needs worker_mode = multinode and the pool's Redis (redis_ip, redis_port, "
                "main_server_redis_password); in singlenode mode the server runs its own slots"
            )
        client = await self.redis.start()
        queue = JobQueue.from_config(client, c, watch=self.redis.watch)
        self.store = await open_worker_store(c)
        self.worker = Worker.from_config(queue, c, store=self.store)
        await self.worker.start()
        self.metrics_server = await serve_for(
            self.worker.metrics.registry, c, worker=True, before_scrape=self.worker.sample_metrics
        )
        if (interval := sd_notify.watchdog_interval()) is not None:
            self._tasks.spawn(sd_notify.watchdog(interval), "watchdog")
        w = self.worker
        sd_notify.ready(f"worker {w.id}: {w.slots} slots, queues {', '.join(w.queues)}")

    def force(self) -> None:
        if self.worker is not None:
            self.worker.force()

    async def stop(self) -> None:
        """Drain the worker, then close what start() opened, in reverse order. Safe to call twice."""
        if self.worker is not None:
            sd_notify.stopping(f"draining {len(self.worker.running)} running jobs")
            await self.worker.stop()
            self.worker = None
        if self.metrics_server is not None:
            await self.metrics_server.close()
            self.metrics_server = None
        await self._tasks.stop()
        if self.store is not None:
            await self.store.close()
            self.store = None
        await self.redis.stop()
