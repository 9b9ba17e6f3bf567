"""Worker mode: claim jobs FIFO from the pool's queues and run each on its own slot and GPUs.

A `Worker` has `slots` slots. One dispatcher task claims while a slot is free: `JobQueue.claim_many`
tries the queues in priority order, and when nothing is claimable the dispatcher blocks on
`JobQueue.wait_for_work` (XREAD BLOCK on the streams, never sleep-polling) until an entry arrives,
or until one of its own jobs ends and gives back GPUs the queue's head job was waiting for. One
claim takes as many jobs as there are free slots, and only one claim is in flight at a time, so
the free GPUs it was sized by (each claimed job's taken out for the next) are still free when the
jobs are given theirs (gpus.GpuAllocator). Each claim is told when the worker's running jobs end
at the latest (backfill); while every slot is taken, in a queue where priorities preempt, the
dispatcher claims nothing but looks at each new job whether it should stop lower ones here. A
worker without GPUs whose jobs are short claims two more while every slot is taken, and starts
each on a slot as it frees: the fast path (fast_path.py), which the dispatcher asks.

Every attempt the worker holds is one `attempt.HeldAttempt`, in one map keyed by lease id, from its
claim until its end is recorded; it runs as a `runner.JobRun` in a task of its own. Its slot is
free as soon as its processes are gone for a job that changed none of its directories (the
common short job), while its end is recorded; else once its run is over, the slot's next job
waiting for the directories' reset. The heartbeat
(heartbeat.py) renews every held lease in one round trip, and its answers, by lease, move each
attempt's self-fence deadline or end the attempt (LOST, CANCEL). The fence task kills an attempt
whose deadline passes; the orphan guard (orphan_guard.py) holds the same deadlines, for when this
process is frozen. Claims wait while the heartbeat fails, and for a while after Redis restarts
(claim_gate.py says why).

Stopping is two-phase: stopping.py. What the worker tells others about itself (its registration,
leases and answers for the heartbeat, its metrics, the reads of its books) is worker_view.py. Why
one class of ~500 lines: its life cycle, its claims and its attempts share one set of books (the
held attempts, the slots) and the events that wake the dispatcher; the parts that stand alone live
beside it: attempt.py (the record and its fence), claim_gate.py, fast_path.py, gpu_books.py (what
it keeps about its GPUs: who holds which, their readings and health), heartbeat.py, outcomes.py
(recording an attempt's end), runner.py (the processes), slots.py (what the machine gives the
slots: directories, uids, cgroups, the spawner and the orphan guard), stopping.py (its stop, a
mixin on the same books), work_watch.py (its wait for work), worker_view.py (the heartbeat's and
the metrics' view of it, a mixin on the same books).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from daemon.aio import TaskSet, woken_or
from daemon.errors import NotReplicated, RedisUnavailable
from daemon.git import ANY_PROTOCOL
from daemon.job import Lease
from daemon.metrics.transfers import MeteredStore
from daemon.metrics.worker import GpuSampler, WorkerMetrics
from daemon.queue import keys, registry
from daemon.queue.claims import Capacity
from daemon.queue.job_queue import JobQueue
from daemon.queue.registry import Registration
from daemon.worker import fast_path
from daemon.worker.attempt import HeldAttempt, Holdings, Phase, boottime
from daemon.worker.claim_gate import ClaimGate
from daemon.worker.confine import Confinement
from daemon.worker.env_build import EnvSettings
from daemon.worker.envs import EnvCache
from daemon.worker.execs import Execs
from daemon.worker.fast_path import FastPath
from daemon.worker.gpu_books import GpuBooks
from daemon.worker.gpus import GpuInfo, GpuProbe, NotEnoughGpus
from daemon.worker.heartbeat import Heartbeat
from daemon.worker.host import HostResources, host_ends
from daemon.worker.identity import SlotIdentity
from daemon.worker.idle_gpus import IdlePolicy
from daemon.worker.lifetime import Lifetime
from daemon.worker.outcomes import Outcomes
from daemon.worker.run_types import Ending, Run, RunResult, passed_env
from daemon.worker.runner import JobRun
from daemon.worker.slots import Slots
from daemon.worker.stopping import Stage, Stopping
from daemon.worker.work_watch import WorkWatch
from daemon.worker.worker_view import WorkerView
from storage.base import ObjectStore
from storage.cache import ObjectCache

log = logging.getLogger(__name__)

# An attempt's executor, given its GPUs and slot.
RunFactory = Callable[[Lease, tuple[GpuInfo, ...], int], Run]


class Worker(WorkerView, Stopping):
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
        shell_idle_limit: float = 3600.0,
        job_nice: int = 0,
        job_network: str = "host",
        gpus: Sequence[GpuInfo] | None = None,
        probe: GpuProbe | None = None,
        worker_id: str | None = None,
        env: Mapping[str, str] | None = None,
        store: ObjectStore | None = None,
        cache_bytes: int = 50 * 1024**3,
        make_run: RunFactory | None = None,
        identities: Sequence[SlotIdentity] | None = None,
        git_protocols: str = ANY_PROTOCOL,
        gpu_max_jobs: int = 4,
        lifetime: Lifetime | None = None,
        gpu_sampler: GpuSampler | None = None,
        look_ahead_below: float = fast_path.BELOW,
        look_ahead_hold: float = fast_path.HOLD,
        env_settings: EnvSettings | None = None,
        env_builder: SlotIdentity | None = None,
        local: bool = True,
        gpu_health_policy: str = "requeue",
        gpu_health_clear: float = 600.0,
        idle_gpus: IdlePolicy | None = None,
        host: HostResources | None = None,
    ) -> None:
        """`env` is the base of every job's environment (default: this process's). `store` (open, owned by the
        caller) holds datasets and artifacts; the worker caches what it fetches from it under
        `data_dir/cache`, up to `cache_bytes`. `make_run` replaces the runner (JobRun) with another executor:
        a benchmark's no-op one measures the queue and this dispatcher without processes. `identities` (one
        per slot, identity.py) are the uids the slots' jobs run as; None: the worker's own. `job_network`:
        "host" or "private", for jobs with a uid of their own (confine.py). `lifetime`: its end, if any
        (lifetime.py). Without GPUs and with the queue's `fast_path` on, jobs are claimed ahead of a free slot
        while jobs end within `look_ahead_below` seconds, and handed back if not started after
        `look_ahead_hold` (fast_path.py). A job whose directory holds a lock runs in the environment built
        from it, kept under `data_dir/envs` as `env_settings` say, built as `env_builder` (None: this
        process's uid) (envs.py). `local`: False for an agent's slots (hosted.py): nothing of this machine is
        opened for them. `host`: the CPUs and memory its jobs may have (host.py), which claims fit with its
        GPUs; None: not counted, every job fits them. The GPUs (`gpus`, `probe`, `gpu_sampler`,
        `gpu_max_jobs`, `gpu_health_policy`, `gpu_health_clear`, `idle_gpus`: default, flagged after 30
        minutes below 5 %, no queue acts) are kept in `gpu_books` (gpu_books.GpuBooks says what each is)."""
        if slots < 1:
            raise ValueError("a worker needs at least one slot")
        if identities is not None and len(identities) < slots:
            raise ValueError("a worker with identities needs one for each slot")
        self.identities = list(identities) if identities is not None else None
        self.git_protocols = git_protocols
        self.queue = queue
        self.data_dir = Path(data_dir)
        self.slots = slots
        self.queues = list(queues)
        self.drain_timeout = drain_timeout
        self.kill_grace = kill_grace
        self.shell_idle_limit = shell_idle_limit  # a tty job's without an idle limit of its own
        self.id = worker_id or registry.new_worker_id()
        # Taken once: os.environ decodes every variable on each read, and every job starts from
        # what it passes on (a filter of every variable on each cold start was a cost to each).
        self.env = passed_env(os.environ if env is None else env)
        self.store: ObjectStore | None = None
        self.cache: ObjectCache | None = None
        if store is not None:  # every byte to and from it is counted where it crosses (metrics/transfers.py)
            self.store = MeteredStore(store, self._transferred)
            self.cache = ObjectCache(self.data_dir / "cache", self.store, cache_bytes)
        self._make_run = make_run or self._job_run
        self.host = host  # the CPUs and memory its jobs may have (None: not counted)
        self.heartbeat = Heartbeat(queue, self, heartbeat_seconds)
        self._registration = Registration(
            id=self.id,
            slots=slots,
            queues=self.queues,
            healthy_period=queue.lease_ms / 1000,
            heartbeat_every=heartbeat_seconds,
            serves=queue.serve_user,
        )
        self.lifetime, self._registration.leave_by = lifetime, lifetime.leave_by if lifetime else 0.0
        # directories, uids, cgroups, the spawner and the orphan guard (slots.py)
        confinement = Confinement(job_network)
        self._slots = Slots(
            self.data_dir, self.id, slots, self.identities, job_nice, confinement=confinement, local=local
        )
        self.envs = EnvCache(
            self.data_dir / "envs",
            env_settings or EnvSettings(),
            builder=env_builder,
            sweep=self._slots.spawner.sweep,
            env=self.env,
        )
        self.metrics = WorkerMetrics()  # replaced at start(), once the GPUs are known
        self._held = Holdings(self._slots.guard)  # every attempt this worker holds, by lease id
        self._wake = asyncio.Event()  # GPUs came back, or the drain began: claim again
        # its GPUs: who holds which, their readings and health (gpu_books.py)
        self.gpu_books = GpuBooks(
            queue,
            self._held,
            gpus,
            gpu_sampler,
            probe,
            slots=slots,
            max_jobs=gpu_max_jobs,
            health=(gpu_health_policy, gpu_health_clear),
            idle=idle_gpus or IdlePolicy(),
            every=heartbeat_seconds,
            wake=self._wake,
            spawn=self._spawn,
        )
        # what the fast path does here, and the jobs it claimed before a slot is free
        self._fast = FastPath(queue.fast_path, self._held, below=look_ahead_below, hold=look_ahead_hold)
        self._ahead = self._fast.look_ahead
        self._attempts = TaskSet("%s failed in the worker; its lease will expire")  # one per attempt
        # heartbeat, cancel nudges, dispatcher, fence, restart watch, quarantine checks
        self._background = TaskSet("%s failed: the worker no longer works as it should", logging.CRITICAL)
        self._dispatcher: asyncio.Task[None] | None = None
        self._slot_freed = asyncio.Event()
        self._gate = ClaimGate(queue, self.heartbeat, self.queues)
        self._watch = WorkWatch(queue, self.id, self.queues)
        self._stage = Stage.WORKING
        self._forced = asyncio.Event()
        self._outcomes = Outcomes(queue, self._forced)  # records each attempt's end
        self._stopped = asyncio.Event()

    # -- life cycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Find the GPUs, register (raises RedisUnavailable when Redis does not answer), then
        start the heartbeat, the fence and the dispatcher. On failure nothing is left running."""
        gpus = await self.gpu_books.find(self.heartbeat.interval)
        self._fast.begin(gpus)
        self.metrics = self.gpu_books.metrics()
        self.heartbeat.observer = self._observe_heartbeat
        self._registration.started_at = time.time()
        if self.host is not None:  # what its jobs may have: the server refuses a job asking for more
            self._registration.cpus, self._registration.job_memory = self.host.cpus, self.host.mem
        try:
            await self._slots.open()
            if self._slots.local:  # an agent's jobs get their environments on its own machine
                await asyncio.to_thread(self.envs.open)
                await self.envs.start()
            if not await self.heartbeat.beat_and_apply():
                raise RedisUnavailable(
                    f"worker {self.id} cannot register: Redis did not take its first heartbeat "
                    "(the warning before this says why)"
                )
            await self._gate.at_start()
        except BaseException:
            await self.envs.close()
            await self._slots.close()
            await self.gpu_books.close()
            raise
        self._spawn(self._slots.guard.watch_over(), "orphan guard watch")
        self._spawn(self.heartbeat.run(), "heartbeat")
        self.gpu_books.start(self._runs, self.heartbeat.interval)  # the readings, the health watch
        execs = Execs(self.queue.redis, self._held, self._slots.spawner, self._spawn)
        self._spawn(
            self.heartbeat.listen_for_pokes(keys.worker_channel(self.id), execs.message),
            "cancel nudges and channels",
        )
        fence = (
            f"no lease renewal for {self.heartbeat.lease - self.heartbeat.margin:.1f} s: the lease "
            "may have passed to another worker"
        )
        self._spawn(self._held.fence(fence), "fence")
        if self.queue.watch is not None:
            self._spawn(self._gate.watch(), "restart watch")
        self._dispatcher = self._spawn(self._dispatch(), "dispatcher")
        log.info(
            "worker %s ready: %d slots, queues %s, %s",
            self.id,
            self.slots,
            ", ".join(self.queues),
            f"{len(gpus)} GPUs ({self.gpu_books.allocator.share} per slot)" if gpus else "CPU only",
        )

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task: asyncio.Task[None] = self._background.spawn(coro, f"{name} {self.id}")
        return task

    # -- claiming ---------------------------------------------------------------------------------

    async def _dispatch(self) -> None:
        try:
            await self._claim_until_drained()
        finally:
            await self._watch.close()  # its read, kept from one wait to the next

    async def _claim_until_drained(self) -> None:
        backoff = 0.1
        preempts = bool(self.queue.preempt.intersection(self.queues))
        claim_first = True  # False: the last wait's standing claim got fewer jobs than it asked for
        while not self.draining():
            full = self._busy() >= self.slots
            ahead = self._ahead.wanted()
            if full and not ahead and not preempts:
                self._slot_freed.clear()
                if self._busy() >= self.slots:
                    await self._wait_for_a_slot()
                continue
            await self._gate.opened(self._wake, self.draining)
            if self.draining():
                break
            try:
                if full and not ahead:  # every slot taken: claim nothing, see if a job should preempt here
                    self._wake.clear()
                    await self.queue.preempt_check(self.id, self.queues, await self._capacity(shared=False))
                    claimed = False
                elif claim_first or self._wake.is_set():
                    # Cleared before the claim: GPUs freed while it is in flight still wake the wait below.
                    self._wake.clear()
                    claimed = await self._claim()
                else:  # the standing claim found the queues empty, and nothing has changed since
                    claimed = False
                backoff = 0.1  # Redis answered: the next failure starts the back-off afresh
                claim_first = True
                if not claimed:
                    claim_first = await self._wait_for_work()
            except Exception as exc:  # logged and retried: a dispatcher that dies never claims again
                claim_first = True
                if isinstance(exc, RedisError | NotReplicated):
                    log.warning("claiming failed (%s); retrying in %.1f s", exc, backoff)
                else:
                    log.exception("claiming failed unexpectedly; retrying in %.1f s", backoff)
                # A back-off between retries (not a poll for work) that the drain cuts short.
                await woken_or(self._wake, backoff)
                backoff = min(backoff * 2, 5.0)

    async def _capacity(self, *, shared: bool = True) -> Capacity:
        """What this worker can take now (claims.Capacity): its GPUs free whole, a slot's share, in
        all, when the attempts holding some end at the latest (backfill), the time a pilot has left
        (a preemption check says it too: a pilot stops nothing for a job it would not take), and
        with `shared` those that can take a --gpu-mem job (NVML's free memory read now)."""
        room = dataclasses.replace(
            self.gpu_books.capacity(self.kill_grace),
            lifetime=self.lifetime.claim_lifetime() if self.lifetime else None,
        )
        if self.host is not None:
            cpus_free, mem_free = self.host.free(self._held)
            room = dataclasses.replace(
                room,
                cpus_free=cpus_free,
                cpus_total=self.host.cpus,
                mem_free=mem_free,
                mem_total=self.host.mem,
                host_ends=host_ends(self._held, self.kill_grace),
            )
        return await self.gpu_books.shared(room) if shared else room

    async def _claim(self) -> bool:
        """One claim for every free slot; the jobs claimed are started (or given back, when the
        drain began meanwhile). True when the queues may have more for this worker now: a claim
        that got fewer jobs than it asked for found its queues empty (or their heads waiting for
        GPUs), and the next one waits for work rather than ask again at once."""
        generation, sent = self._generation(), boottime()
        free = self.slots - self._busy()
        wanted = free + self._ahead.wanted()
        room = await self._capacity()
        leases = await self.queue.claim_many(self.id, self.queues, wanted, room, urgent=free > 0, slots=free)
        return await self._claimed(leases, wanted, generation, sent)

    def _generation(self) -> int:
        """How many Redis restarts the worker has seen (claim_gate.py): a claim sent before one
        and answered after it waits for the pause that follows."""
        return self.queue.watch.generation if self.queue.watch is not None else 0

    async def _claimed(self, leases: list[Lease], wanted: int, generation: int, sent: float) -> bool:
        """Start (or keep ahead, or give back) the jobs a claim sent at `sent` got, as `_claim`
        says."""
        # Shared GPUs first: one the claim chose for a --gpu-mem job may be free whole now.
        leases.sort(key=lambda lease: not lease.spec.gpu_mem)
        if not leases:
            return False
        deadline = sent + self.heartbeat.lease - self.heartbeat.margin
        if self.draining():  # the drain began during the claim: the jobs go back first
            self._hand_back(leases, deadline)
            return True
        if self._generation() != generation:
            # Claimed from a Redis that had just restarted: the pause is for these too. Held (and
            # renewed) meanwhile, so they are not lost; started after it, while still valid.
            held = [self._held.hold(lease, deadline) for lease in leases]
            self._gate.restarted()
            await self._gate.opened(self._wake, self.draining)
            still = [h for h in held if self._held.holds(h) and not h.expired()]
            for h in held:
                self._held.drop(h)
            if self.draining():
                self._hand_back([h.lease for h in still], deadline)
                return True
            for h in still:
                self._start_or_keep(h.lease, h.deadline)  # as renewed while it waited
            return True
        for lease in leases:
            self._start_or_keep(lease, deadline)
        await asyncio.sleep(0)  # jobs `start` left to their tasks: their first steps (to their spawn) first
        return len(leases) == wanted

    def _start_or_keep(self, lease: Lease, deadline: float) -> None:
        """Start a job claimed on a free slot; one claimed ahead (every slot taken) is kept."""
        if self._busy() < self.slots:
            self._launch(lease, deadline)
        else:
            self._ahead.keep(self._held.hold(lease, deadline))

    async def _wait_for_a_slot(self) -> None:
        """Every slot is taken: wait until one is free, handing back the jobs kept ahead if none is
        free by the time it has waited its longest (fast_path.py)."""
        try:
            async with asyncio.timeout(self._ahead.due_in()):
                await self._slot_freed.wait()
        except TimeoutError:
            for held in self._ahead.give_up():
                log.info("job %s: no slot free in %g s; handing it back", held.lease.job_id, self._ahead.hold)
                self._hand_back([held.lease], held.deadline)

    async def _wait_for_work(self) -> bool:
        """Block until a queue gets a new entry, or `_wake` is set, leaving this worker's next
        claim standing meanwhile where the fast path says so (work_watch.py); what that claim got, once
        an enqueue sent it, is started here. True when the next step is a claim; False when the
        standing claim got fewer jobs than it asked for: it found the queues empty, as a claim
        that returned does (`_claim`), and the next step waits again."""
        generation, sent = self._generation(), boottime()
        free = self.slots - self._busy()
        wanted = free + self._ahead.wanted()
        claim = None  # none stands on a GPU worker (work_watch.py), nor with the fast path off
        if self._fast.stands():  # and none goes while claims may not (claim_gate.py)
            claim = {
                "count": wanted,
                "slots": free,
                "ready": self._gate.open_now,
                "capacity": await self._capacity(),
            }
        leases = await self._watch.wait(self._wake, claim)
        return leases is None or await self._claimed(leases, wanted, generation, sent)

    def _launch(self, lease: Lease, deadline: float) -> None:
        for other in self._held:
            if other.lease.job_id == lease.job_id and other.run is not None:
                # a newer lease of the job exists, so this one was reclaimed
                other.run.lose("the job was reclaimed from this attempt")
        slot = min(set(range(self.slots)) - {h.slot for h in self._held})
        try:
            gpus = self.gpu_books.allocate(lease, slot)
        except NotEnoughGpus as exc:  # claims are sized by free GPUs, so this is a bug: say so
            log.error("%s; handing the attempt back", exc)
            self._hand_back([lease], deadline)
            return
        held = self._held.hold(lease, deadline)
        run = self._make_run(lease, gpus, slot)
        self._held.started(held, run, slot)  # (lost there if its deadline passed: nothing starts)
        if not held.fenced:
            if lease.ahead:  # it counts as started from here
                self._fast.say_started(self.queue, lease)
            self.metrics.job_started(lease.spec.queue)
        self.gpu_books.gpu_watch.begin(held)
        run.start()  # now, when nothing has to come first; else its task prepares and starts it
        held.task = self._attempts.spawn(self._attempt(held), f"job {lease.job_id}")

    def _job_run(self, lease: Lease, gpus: tuple[GpuInfo, ...], slot: int) -> Run:
        health = self.gpu_books.health  # a job that fails by itself is checked for its GPUs' fault at its end
        return JobRun(
            self.queue,
            lease,
            data_dir=self.data_dir,
            gpus=gpus,
            env=self.env,
            kill_grace=self.kill_grace,
            shell_idle_limit=self.shell_idle_limit,
            probe=self.gpu_books.probe,
            gpu_asks=self.gpu_books.pids_asks,
            guard=self._slots.guard,
            spawner=self._slots.spawner,
            store=self.store,
            cache=self.cache,
            envs=self.envs,
            slot=self._slots.scratch[slot],
            identity=self._slots.identity(slot),
            cgroup=self._slots.cgroup(slot),
            limits=self._slots.limit(slot),
            git_protocols=self.git_protocols,
            eager=self._fast.eager,
            on_slot_free=functools.partial(self._slot_free, lease.id) if self._fast.eager else None,
            gpu_fault=functools.partial(health.fault_under, gpus) if health is not None and gpus else None,
        )

    def _slot_free(self, lease_id: str) -> None:
        """The attempt's processes are gone and it left its slot as it found it (runner.py
        `_hand_over`): the slot takes its next job now, while this one's end is recorded."""
        held = self._held.get(lease_id)
        if held is not None and held.slot is not None:
            held.phase = Phase.ENDING
            self._free(held, None)

    def _hand_back(self, leases: Iterable[Lease], deadline: float) -> None:
        """Hand back attempts that never ran (held, so renewed, until the hand-back is recorded)."""
        for lease in leases:
            held = self._held.hold(lease, deadline)
            held.phase = Phase.ENDING
            held.task = self._attempts.spawn(self._hand_back_now(held), f"hand back {lease.job_id}")

    async def _hand_back_now(self, held: HeldAttempt) -> None:
        lease = held.lease
        try:
            await self._outcomes.hand_back(lease)
        finally:
            self._held.drop(held)

    # -- one attempt ------------------------------------------------------------------------------

    async def _attempt(self, held: HeldAttempt) -> None:
        lease, run = held.lease, held.run
        assert run is not None
        if log.isEnabledFor(logging.INFO):
            # Written a turn later: this step spawns the job (unless `start` did, or it has data
            # to fetch first), and a log line (costly after an idle while, and a wake of
            # whoever reads it) is no part of a job's start.
            gpus = ", ".join(str(g.index) for g in run.gpus) or "none"
            asyncio.get_running_loop().call_soon(
                log.info,
                "job %s attempt %d: starting on slot %d, GPUs %s",
                lease.job_id,
                lease.attempt,
                held.slot,
                gpus,
            )
        result: RunResult | None = None
        tidied = False
        in_time = self._stop_in_time(lease, run)
        try:
            try:
                result = await run.run()
                held.phase = Phase.ENDING
                if self._ahead:  # a job kept ahead waits for this slot: its directories first
                    await run.tidy()
                    tidied = True
            finally:
                if in_time is not None:
                    in_time.cancel()  # it holds nothing: cancelled, it ends in the next turn
                held.phase = Phase.ENDING
                if held.slot is not None:  # (else freed, its directories as new: _slot_free)
                    self._free(held, result)
                    if not tidied:
                        self._attempts.spawn(self._tidy(run), f"tidy after {lease.job_id}")
            if result.killed_by is not None and result.ending is not Ending.LOST and held.expired():
                # Killed by a signal after the fence deadline: maybe by the fence itself (the orphan
                # guard, while this worker was frozen). Not the job's outcome: the lease decides.
                result = RunResult(Ending.LOST, None, result.dirty_gpus, result.killed_by)
            result = self.gpu_books.gpu_watch.summarised(held, result, self.metrics)
            await self.gpu_books.gpu_watch.recorded(held)  # its idle record first: the end it explains
            # While short jobs flow and another runs, its end comes soon: this outcome may wait for it.
            await self._outcomes.report(held.lease, result, self._fast.linger(self._busy()))
        finally:
            self._held.drop(held)

    def _stop_in_time(self, lease: Lease, run: Run) -> asyncio.Task[None] | None:
        """A pilot's: the task that stops the job in time for its own stop grace (its
        --stop-grace, else kill_grace), so that it is handed back before the worker's end
        (lifetime.py); None on a worker with no end."""
        if self.lifetime is None or not self.lifetime.max_lifetime:
            return None
        grace = lease.spec.stop_grace or self.kill_grace
        stopping = self.lifetime.stop_in_time(lease.job_id, grace, lambda why: run.hand_back(why=why))
        return self._attempts.spawn(stopping, f"end of {lease.job_id}")

    @staticmethod
    async def _tidy(run: Run) -> None:
        """The slot's directories made ready for its next job, which waits for them: a turn of the
        loop later, so that the slot's next claim and this attempt's outcome (made in this turn and
        the next) are on their way to Redis first, and the tidying is done while they travel."""
        await asyncio.sleep(0)
        await run.tidy()

    def _free(self, held: HeldAttempt, result: RunResult | None) -> None:
        """Give the attempt's slot and GPUs back (the dirty ones into quarantine)."""
        self.gpu_books.release(held.lease, result)
        held.slot = None
        self._ahead.ended(boottime() - held.since)
        if not self.draining() and (ahead := self._ahead.next()) is not None:
            self._launch(ahead.lease, ahead.deadline)  # on the slot just freed, with no round trip
        self._slot_freed.set()
        self._wake.set()  # a slot to claim for, and the head of a queue may have waited for these GPUs
        self.gpu_books.check_quarantine()
