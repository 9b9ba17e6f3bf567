"""Worker mode: claim jobs FIFO from the pool's queues and run each on its own slot and GPUs.

A `Worker` has `slots` slots. One dispatcher task claims while a slot is free: `JobQueue.claim_many`
tries the queues in priority order, and when nothing is claimable the dispatcher blocks on
`JobQueue.wait_for_work` (XREAD BLOCK on the streams, never sleep-polling) until an entry arrives,
or until one of its own jobs ends and gives back GPUs the queue's head job was waiting for. One
claim takes as many jobs as there are free slots, and only one claim is in flight at a time, so
the free GPUs it was sized by (each claimed job's taken out for the next) are still free when the
jobs are given theirs (gpus.GpuAllocator). Each attempt runs as a `runner.JobRun` in a task of its own;
the heartbeat (heartbeat.py) renews every lease in one round trip and relays LOST and CANCEL.

Stopping is two-phase (as in SAQ and uvicorn). `stop()` first stops claiming and lets running
jobs finish for up to `drain_timeout` seconds; then it stops the rest (SIGTERM, SIGKILL after
`kill_grace`) and hands their attempts back to the front of their queues (`JobQueue.release`), so
another worker takes them first. `force()` (a second signal) cuts the wait short and kills at
once; the attempts are still handed back. `stop()` is safe to call twice. A Worker installs no
signal handler: `main` does, for `WorkerDaemon` (worker mode) and the server running local slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from daemon import keys, notify, registry
from daemon.aio import TaskSet, cancel_and_wait
from daemon.config import Config
from daemon.errors import GpupoolError, RedisUnavailable, StaleAttempt
from daemon.gpus import GpuAllocator, GpuInfo, GpuProbe, GpuProbeError, NotEnoughGpus, Nvml, discover
from daemon.heartbeat import Heartbeat
from daemon.job import JobState, Lease, RenewStatus
from daemon.metrics import MetricsServer, WorkerMetrics, serve_for
from daemon.procguard import OrphanGuard
from daemon.queue import JobQueue
from daemon.redis_client import PoolRedis
from daemon.registry import Registration
from daemon.runner import Ending, JobRun, Run, RunResult
from daemon.scratch import SlotDirs
from daemon.store import open_worker_store
from storage.base import ObjectStore
from storage.cache import ObjectCache

log = logging.getLogger(__name__)

# An attempt's executor, given its GPUs and slot.
RunFactory = Callable[[Lease, tuple[GpuInfo, ...], int], Run]

WAIT_BLOCK = 5.0  # longest blocking read for work before claiming again (a safety net only)


class Worker:
    """Runs jobs from `queue` on this machine. `start()`, then `stop()` (see the module doc)."""

    def __init__(
        self,
        queue: JobQueue,
        *,
        data_dir: Path,
        slots: int = 2,
        queues: Sequence[str] = ("default",),
        heartbeat_seconds: float = 30.0,
        drain_timeout: float = 60.0,
        kill_grace: float = 10.0,
        gpus: Sequence[GpuInfo] | None = None,
        probe: GpuProbe | None = None,
        worker_id: str | None = None,
        env: Mapping[str, str] | None = None,
        store: ObjectStore | None = None,
        cache_bytes: int = 50 * 1024**3,
        make_run: RunFactory | None = None,
    ) -> None:
        """`gpus=None` discovers them with NVML at start (`probe` is then NVML); tests pass a list
        (the seam) and optionally a probe. `env` is the base of every job's environment (default:
        this process's). `store` (open, owned by the caller) holds datasets and artifacts; the worker
        caches what it fetches from it under `data_dir/cache`, up to `cache_bytes`. `make_run` replaces
        the runner (JobRun) with another executor: a benchmark's no-op one measures the queue and
        this dispatcher without processes."""
        if slots < 1:
            raise ValueError("a worker needs at least one slot")
        self.queue = queue
        self.data_dir = Path(data_dir)
        self.slots = slots
        self.queues = list(queues)
        self.drain_timeout = drain_timeout
        self.kill_grace = kill_grace
        self.id = worker_id or registry.new_worker_id()
        # Copied once: os.environ decodes every variable on each read, and every job starts from it.
        self.env = dict(os.environ) if env is None else env
        self.store = store
        self.cache = ObjectCache(self.data_dir / "cache", store, cache_bytes) if store is not None else None
        self._make_run = make_run or self._job_run
        self._given_gpus = gpus
        self.probe = probe
        self.allocator = GpuAllocator(gpus or [], slots)
        self.heartbeat = Heartbeat(queue, self, heartbeat_seconds)
        self._registration = Registration(
            id=self.id, slots=slots, queues=self.queues, healthy_period=queue.lease_ms / 1000
        )
        self._slot_dirs = SlotDirs(self.data_dir / "slots", self.id)
        self._guard = OrphanGuard(f"GPUPOOL_WORKER={self.id}")
        self.metrics = WorkerMetrics()  # replaced at start(), once the GPUs are known
        self._nvml: Nvml | None = None
        # Running attempts by (job id, attempt): a job reclaimed from under this worker can be
        # claimed by it again while the old attempt is still being killed.
        self._runs: dict[tuple[str, int], Run] = {}
        self._slot_of: dict[tuple[str, int], int] = {}
        self._leases: dict[str, Lease] = {}  # job id -> newest lease, renewed until its end is recorded
        self._tasks: set[asyncio.Task[None]] = set()  # one per attempt
        # heartbeat, cancel nudges, dispatcher, quarantine checks
        self._background = TaskSet("%s failed: the worker no longer works as it should", logging.CRITICAL)
        self._dispatcher: asyncio.Task[None] | None = None
        self._slot_freed = asyncio.Event()
        self._wake = asyncio.Event()  # GPUs came back, or the drain began: claim again
        self._draining = False
        self._handing_back = False
        self._forced = asyncio.Event()
        self._stop_started = False
        self._stopped = asyncio.Event()

    @classmethod
    def from_config(
        cls,
        queue: JobQueue,
        config: Config,
        *,
        slots: int | None = None,
        data_dir: Path | None = None,
        store: ObjectStore | None = None,
    ) -> Worker:
        """A worker with the configuration's queues, timings, cache size and (default) remote slot
        count, on `store` (opened by the caller)."""
        return cls(
            queue,
            data_dir=data_dir or config.data_path() / "worker",
            slots=config.worker_remote_processors if slots is None else slots,
            queues=config.queues,
            heartbeat_seconds=config.heartbeat_seconds,
            drain_timeout=config.drain_timeout,
            kill_grace=config.kill_grace,
            store=store,
            cache_bytes=config.worker_cache_bytes,
        )

    # -- life cycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Find the GPUs, register (raises RedisUnavailable when Redis does not answer), then
        start the heartbeat and the dispatcher."""
        if self._given_gpus is None:
            gpus, self._nvml = await asyncio.to_thread(discover)
            self.allocator = GpuAllocator(gpus, self.slots)
            self.probe = self.probe or self._nvml
        self.metrics = WorkerMetrics(self.allocator.gpus)
        await asyncio.to_thread(self._slot_dirs.open)
        self.heartbeat.observer = self._observe_heartbeat
        self._registration.started_at = time.time()
        await self._guard.start()
        if not await self.heartbeat.beat_and_apply():
            await self._guard.stop()
            await asyncio.to_thread(self._slot_dirs.close)
            raise RedisUnavailable(f"worker {self.id} cannot register: Redis does not answer")
        self._spawn(self.heartbeat.run(), "heartbeat")
        self._spawn(self.heartbeat.listen_for_pokes(keys.worker_channel(self.id)), "cancel nudges")
        self._dispatcher = self._spawn(self._dispatch(), "dispatcher")
        gpus = self.allocator.gpus
        log.info(
            "worker %s ready: %d slots, queues %s, %s",
            self.id,
            self.slots,
            ", ".join(self.queues),
            f"{len(gpus)} GPUs ({self.allocator.share} per slot)" if gpus else "CPU only",
        )

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task: asyncio.Task[None] = self._background.spawn(coro, f"{name} {self.id}")
        return task

    async def stop(self, drain_timeout: float | None = None) -> None:
        """Phase 1: stop claiming, let running jobs finish for up to `drain_timeout` seconds (the
        configured one by default). Phase 2: stop the rest and hand their attempts back. A second
        call waits for the first (with `drain_timeout=0` it forces it). If this coroutine is
        cancelled, the jobs are SIGKILLed at once and their leases left to expire."""
        if self._stop_started:
            if drain_timeout == 0:
                self.force()
            await self._stopped.wait()
            return
        self._stop_started = True
        try:
            await self._drain(self.drain_timeout if drain_timeout is None else drain_timeout)
            await self._hand_back_the_rest()
            await self._shutdown()
        except asyncio.CancelledError:
            for run in self._runs.values():
                run.lose("the worker was stopped at once")
            raise
        finally:
            self._stopped.set()

    def force(self) -> None:
        """End the drain now; stop jobs with SIGKILL instead of SIGTERM (a second signal)."""
        self._forced.set()
        if self._handing_back:
            for run in self._runs.values():
                run.hand_back(now=True)

    async def _drain(self, grace: float) -> None:
        self._draining = True
        self._registration.state = registry.DRAINING
        self._wake.set()
        self._slot_freed.set()
        if self._dispatcher is not None:
            # It is in a claim (a short script call) or waiting, which the wake-up ends.
            done, _ = await asyncio.wait({self._dispatcher}, timeout=10)
            if not done:
                await cancel_and_wait(self._dispatcher)
        if not self._tasks:
            return
        log.info("draining: waiting up to %g s for %d running jobs", grace, len(self._tasks))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        forced = asyncio.ensure_future(self._forced.wait())
        try:
            while self._tasks and not self._forced.is_set() and loop.time() < deadline:
                await asyncio.wait(
                    {*self._tasks, forced},
                    timeout=deadline - loop.time(),
                    return_when=asyncio.FIRST_COMPLETED,
                )
        finally:
            forced.cancel()

    async def _hand_back_the_rest(self) -> None:
        self._handing_back = True
        if self._runs:
            log.info("stopping %d running jobs; their attempts go back to the queue", len(self._runs))
        for run in self._runs.values():
            run.hand_back(now=self._forced.is_set())
        if self._tasks:
            await asyncio.wait(set(self._tasks))

    async def _shutdown(self) -> None:
        await self._background.stop()
        try:
            await registry.unregister(self.queue.redis, self.id)
        except RedisError as exc:
            log.warning("could not unregister worker %s (%s); it will show as dead", self.id, exc)
        await self._guard.stop()
        await asyncio.to_thread(self._slot_dirs.close)
        if self.cache is not None:
            await self.cache.close()
        if self._nvml is not None:
            await asyncio.to_thread(self._nvml.close)
            self._nvml = None
        log.info("worker %s stopped", self.id)

    # -- claiming ---------------------------------------------------------------------------------

    async def _dispatch(self) -> None:
        backoff = 0.1
        while not self._draining:
            if len(self._runs) >= self.slots:
                self._slot_freed.clear()
                if len(self._runs) >= self.slots:
                    await self._slot_freed.wait()
                continue
            # Cleared before the claim: GPUs freed while it is in flight still wake the wait below.
            self._wake.clear()
            try:
                leases = await self.queue.claim_many(
                    self.id,
                    self.queues,
                    self.slots - len(self._runs),
                    self.allocator.free_count(),
                    self.allocator.share,
                )
                backoff = 0.1  # Redis answered: the next failure starts the back-off afresh
                if not leases:
                    await self._wait_for_work()
                    continue
            except RedisError as exc:
                log.warning("claiming failed (%s); retrying in %.1f s", exc, backoff)
                # A back-off between retries (not a poll for work) that the drain cuts short.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(backoff):
                        await self._wake.wait()
                backoff = min(backoff * 2, 5.0)
                continue
            if self.draining():  # the drain began during the claim: the jobs go back first
                for lease in leases:  # renewed by the heartbeat until each is given back
                    self._leases[lease.job_id] = lease
                for lease in leases:
                    await self._give_back(lease)
            else:
                for lease in leases:
                    self._launch(lease)

    async def _wait_for_work(self) -> None:
        """Block until a queue gets a new entry, or `_wake` is set (whichever comes first)."""
        read = asyncio.ensure_future(self.queue.wait_for_work(self.queues, WAIT_BLOCK))
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({read, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Cancelling a blocked XREAD makes redis-py drop its connection: a clean state.
            await cancel_and_wait(read)
            await cancel_and_wait(woken)
        if not read.cancelled() and (exc := read.exception()) is not None:
            raise exc

    def _launch(self, lease: Lease) -> None:
        for (job_id, _), old in self._runs.items():
            if job_id == lease.job_id:  # a newer attempt exists, so this one was reclaimed
                old.lose("the job was reclaimed from this attempt")
        slot = min(set(range(self.slots)) - set(self._slot_of.values()))
        try:
            gpus = self.allocator.allocate(_holder(lease), lease.spec.gpus, slot)
        except NotEnoughGpus as exc:  # claims are sized by free GPUs, so this is a bug: say so
            log.error("%s; handing the attempt back", exc)
            task = asyncio.ensure_future(self._give_back(lease))
        else:
            run = self._make_run(lease, gpus, slot)
            self._runs[_key(lease)] = run
            self._slot_of[_key(lease)] = slot
            self._leases[lease.job_id] = lease
            task = asyncio.ensure_future(self._attempt(run, slot))
        task.set_name(f"job {lease.job_id}")
        self._tasks.add(task)
        task.add_done_callback(self._attempt_done)

    def _job_run(self, lease: Lease, gpus: tuple[GpuInfo, ...], slot: int) -> Run:
        return JobRun(
            self.queue,
            lease,
            data_dir=self.data_dir,
            gpus=gpus,
            env=self.env,
            kill_grace=self.kill_grace,
            probe=self.probe,
            guard=self._guard,
            store=self.store,
            cache=self.cache,
            slot_dir=self._slot_dirs.slot(slot),
        )

    def _attempt_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("%s failed in the worker; its lease will expire", task.get_name(), exc_info=exc)

    async def _give_back(self, lease: Lease) -> None:
        """Hand back an attempt that never ran (the heartbeat renews it meanwhile)."""
        self._leases[lease.job_id] = lease
        try:
            await self._record(lease, "hand back", lambda: self.queue.release(lease))
        finally:
            self._drop_lease(lease)

    def _drop_lease(self, lease: Lease) -> None:
        if self._leases.get(lease.job_id) is lease:  # not a newer attempt's
            del self._leases[lease.job_id]

    # -- one attempt ------------------------------------------------------------------------------

    async def _attempt(self, run: Run, slot: int) -> None:
        lease = run.lease
        gpus = ", ".join(str(g.index) for g in run.gpus) or "none"
        log.info("job %s attempt %d: starting on slot %d, GPUs %s", lease.job_id, lease.attempt, slot, gpus)
        result: RunResult | None = None
        try:
            result = await run.run()
        finally:
            self._free(lease, result)
        try:
            await self._report(lease, result)
        finally:
            self._drop_lease(lease)

    def _free(self, lease: Lease, result: RunResult | None) -> None:
        """Give the attempt's slot and GPUs back (the dirty ones into quarantine)."""
        if result is None:  # the runner failed: no renewals, so the lease expires and it reruns
            self._drop_lease(lease)
        else:
            for uuid, why in result.dirty_gpus.items():
                self.allocator.quarantine(uuid, f"after job {lease.job_id}: {why}")
        self.allocator.release(_holder(lease))
        self._runs.pop(_key(lease), None)
        self._slot_of.pop(_key(lease), None)
        self._slot_freed.set()
        if self.allocator.gpus:
            self._wake.set()  # the head of a queue may have been waiting for these GPUs
            if self.allocator.quarantined and self.probe is not None:
                self._spawn(self._recheck_quarantine(), "quarantine check")

    async def _report(self, lease: Lease, result: RunResult) -> None:
        job = lease.job_id
        if result.ending is Ending.LOST:
            log.warning(
                "job %s attempt %d: lease lost; the job was killed, nothing recorded", job, lease.attempt
            )
        elif result.outcome is None:
            state = await self._record(lease, "hand back", lambda: self.queue.release(lease))
            log.info("job %s attempt %d: handed back (%s)", job, lease.attempt, state)
        else:
            outcome = result.outcome
            state = await self._record(
                lease, "record the outcome", lambda: self.queue.complete(lease, outcome)
            )
            log.info("job %s attempt %d: %s %s", job, lease.attempt, state or outcome.state, outcome.detail)

    async def _record(
        self, lease: Lease, what: str, call: Callable[[], Awaitable[JobState]]
    ) -> JobState | None:
        """Run a fenced write, retrying while Redis is unreachable, for as long as the lease could
        still hold (the heartbeat keeps renewing it meanwhile). None when it could not be made."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.heartbeat.lease
        delay = 0.2
        while True:
            try:
                return await call()
            except StaleAttempt as exc:
                log.warning("job %s: could not %s: %s", lease.job_id, what, exc)
                return None
            except RedisError as exc:
                if loop.time() + delay > deadline or self._forced.is_set():
                    log.error("job %s: could not %s (%s); its lease will expire", lease.job_id, what, exc)
                    return None
                log.warning("job %s: could not %s (%s); retrying", lease.job_id, what, exc)
                await asyncio.sleep(delay)  # a back-off between retries
                delay = min(delay * 2, 5.0)

    async def _recheck_quarantine(self) -> None:
        """A quarantined GPU no process holds memory on any more is clean: back into use."""
        assert self.probe is not None
        for uuid in list(self.allocator.quarantined):
            try:
                busy = await asyncio.to_thread(self.probe.compute_pids, uuid)
            except GpuProbeError:
                continue
            if not busy:
                self.allocator.unquarantine(uuid)
                self._wake.set()

    # -- metrics ----------------------------------------------------------------------------------

    def _observe_heartbeat(self, round_trip: float | None) -> None:
        if round_trip is None:
            self.metrics.heartbeat_failed()
        else:
            self.metrics.heartbeat(round_trip)

    async def sample_metrics(self) -> None:
        """Before each scrape: the slots and quarantined GPUs as they are now."""
        self.metrics.set_slots(len(self._runs), self.slots)
        self.metrics.set_quarantined(self.allocator.quarantined)

    # -- heartbeat target -------------------------------------------------------------------------

    def registration(self) -> Registration:
        self._registration.running = len(self._runs)
        self._registration.gpus = self.allocator.describe()
        return self._registration

    def leases(self) -> Sequence[Lease]:
        return list(self._leases.values())

    def renewed(self, statuses: Mapping[str, RenewStatus]) -> None:
        for job_id, status in statuses.items():
            lease = self._leases.get(job_id)
            run = self._runs.get(_key(lease)) if lease is not None else None
            if run is None:
                continue
            if status is RenewStatus.LOST:
                run.lose("the lease was lost (this worker was presumed dead, or the job ended)")
            elif status is RenewStatus.CANCEL:
                run.cancel()

    def fence(self, reason: str) -> None:
        if self._runs:
            log.error("killing %d running jobs: %s", len(self._runs), reason)
        for run in self._runs.values():
            run.lose(reason)

    # -- reads ------------------------------------------------------------------------------------

    def draining(self) -> bool:
        """True once `stop()` began: no more jobs are claimed."""
        return self._draining

    @property
    def running(self) -> dict[str, Lease]:
        """The attempts running now, by job id."""
        return {job_id: run.lease for (job_id, _), run in self._runs.items()}


def _key(lease: Lease) -> tuple[str, int]:
    return lease.job_id, lease.attempt


def _holder(lease: Lease) -> str:
    """The attempt as a GPU holder: two attempts of one job never share a GPU either."""
    return f"{lease.job_id}#{lease.attempt}"


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
        c = self.config
        if c.embedded:
            raise GpupoolError(
                "worker mode needs worker_mode = multinode and the pool's Redis (redis_ip, redis_port, "
                "main_server_redis_password); in singlenode mode the server runs its own slots"
            )
        client = await self.redis.start()
        queue = JobQueue(
            client, lease_seconds=c.worker_healthy_response_period, retention_seconds=int(c.job_retention)
        )
        self.store = await open_worker_store(c)
        self.worker = Worker.from_config(queue, c, store=self.store)
        await self.worker.start()
        self.metrics_server = await serve_for(
            self.worker.metrics.registry, c, worker=True, before_scrape=self.worker.sample_metrics
        )
        if (interval := notify.watchdog_interval()) is not None:
            self._tasks.spawn(notify.watchdog(interval), "watchdog")
        w = self.worker
        notify.ready(f"worker {w.id}: {w.slots} slots, queues {', '.join(w.queues)}")

    def force(self) -> None:
        if self.worker is not None:
            self.worker.force()

    async def stop(self) -> None:
        """Drain the worker, then close what start() opened, in reverse order. Safe to call twice."""
        if self.worker is not None:
            notify.stopping(f"draining {len(self.worker.running)} running jobs")
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
