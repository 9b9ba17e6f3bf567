"""Worker mode as a daemon (`poold --worker`): the pool's Redis, the object store, one Worker, its
metrics endpoint, readiness and the systemd watchdog; and its end, for a worker that leaves by
itself (lifetime.py: idle, or at its lifetime's end, as a pilot worker on a batch cluster does)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from daemon import sd_notify
from daemon.aio import TaskSet, start_or_undo
from daemon.config import Config, make_data_dir
from daemon.errors import GpupoolError
from daemon.git import ANY_PROTOCOL, NETWORK_PROTOCOLS
from daemon.metrics.endpoint import MetricsServer, serve_for
from daemon.object_store import open_worker_store
from daemon.queue.job_queue import JobQueue
from daemon.queue.pool_redis import PoolRedis
from daemon.worker import non_root
from daemon.worker.dispatcher import Worker
from daemon.worker.identity import slot_identities
from daemon.worker.lifetime import Lifetime
from storage.base import ObjectStore

log = logging.getLogger(__name__)


class WorkerDaemon:
    """Worker mode (`poold --worker`): the pool's Redis, the object store, a Worker, its metrics,
    readiness and watchdog. `main` drives it like the server: `start()`, then on the first signal
    `stop()` (drain), on a second `force()` (stop jobs now; attempts are still handed back).
    `leaving` is set when the worker's lifetime says it must leave: main then stops it as on the
    first signal (a signal after that is the second)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.leaving = asyncio.Event()
        # Read now, near the process's start: a bad worker_max_lifetime stops poold before it connects.
        self.lifetime = Lifetime.of(config)
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
        # A worker not running as root runs every job as itself (non_root.py): one user's only,
        # its data closed to others.
        non_root.check_serve_user(c)
        await asyncio.to_thread(make_data_dir, c.data_path())
        non_root.check_data_dir(c.data_path())
        client = await self.redis.start()
        queue = JobQueue.from_config(client, c, watch=self.redis.watch)
        self.store = await open_worker_store(c)
        self.worker = configured_worker(queue, c, store=self.store, lifetime=self.lifetime)
        await self.worker.start()
        if self.lifetime is not None:
            self._tasks.spawn(self._leave_when_due(self.lifetime, self.worker), "lifetime")
        self.metrics_server = await serve_for(
            self.worker.metrics.registry, c, worker=True, before_scrape=self.worker.sample_metrics
        )
        if (interval := sd_notify.watchdog_interval()) is not None:
            self._tasks.spawn(sd_notify.watchdog(interval), "watchdog")
        w = self.worker
        sd_notify.ready(f"worker {w.id}: {w.slots} slots, queues {', '.join(w.queues)}")

    async def _leave_when_due(self, lifetime: Lifetime, worker: Worker) -> None:
        why = await lifetime.due(worker.idle_for)
        if not self.leaving.is_set():  # not stopping on a signal already (main shares the event)
            log.info("worker %s leaving: %s", worker.id, why)
            self.leaving.set()

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


def configured_worker(
    queue: JobQueue,
    config: Config,
    *,
    slots: int | None = None,
    data_dir: Path | None = None,
    store: ObjectStore | None = None,
    lifetime: Lifetime | None = None,
) -> Worker:
    """A worker with the configuration's queues, timings, cache size and (default) remote slot
    count, on `store` (opened by the caller), leaving by itself as `lifetime` says (None: never)."""
    n = config.worker_remote_processors if slots is None else slots
    identities = slot_identities(config.job_uid_range, n)
    if identities is not None and len(identities) < n:
        # Fewer slots, each safe, rather than no pool (an embedded pool has 32 slots by default).
        log.warning(
            "job_uid_range = %s holds %d uids for %d slots: running %d slots (give it %d uids "
            "to run them all)",
            config.job_uid_range,
            len(identities),
            n,
            len(identities),
            n,
        )
        n = len(identities)
    elif identities is not None and not config.job_uid_range:
        log.info(
            "jobs run as %d uids from %d to %d, leased for this poold alone (set job_uid_range to "
            "choose them)",
            len(identities),
            identities[0].uid,
            identities[-1].uid,
        )
    return Worker(
        queue,
        data_dir=data_dir or config.data_path() / "worker",
        slots=n,
        queues=config.queues,
        heartbeat_seconds=config.heartbeat_seconds,
        drain_timeout=config.drain_timeout,
        kill_grace=config.kill_grace,
        job_nice=config.job_nice,
        job_network=config.job_network,
        store=store,
        cache_bytes=config.worker_cache_bytes,
        identities=identities,
        # A worker of a shared pool never clones a path of its own disk for a job (its mirrors
        # of other users' repositories, anything of root's): network protocols only.
        git_protocols=ANY_PROTOCOL if config.embedded else NETWORK_PROTOCOLS,
        gpu_max_jobs=config.gpu_max_jobs,
        lifetime=lifetime,
    )


def local_slots(queue: JobQueue, config: Config, store: ObjectStore) -> Worker:
    """The slots a single-machine pool's server runs itself (`worker_local_processors`)."""
    return configured_worker(queue, config, slots=config.worker_local_processors, store=store)
