"""A model of the queue's scheduler, checked against the real one (issue 46): a hypothesis
rule-based state machine drives a real JobQueue on a real redis-server with random enqueues,
claims by workers of different sizes, completes, cancels, requeues, hand-backs and reclaims,
under caps, fair share and preemption drawn per example; after every step it checks the
invariants below against Redis itself and against a small Python record of what was enqueued,
what each worker holds and what ended.

The invariants (docs/GUARANTEES.md):
  * places: every job not ended sits in exactly one place (tests/support/queue_places.py), the
    one its record's state says (running under the lease the model's worker holds, else a
    queued place), and a job that ended in none;
  * capacity: no worker runs more jobs than its slots, holds more GPUs than it has, or puts
    more declared memory or jobs on a shared GPU than it takes; each worker's own allocator
    (daemon/worker/gpus.py, fed what the claims said) never runs short either;
  * caps: a user running two jobs or more in the queue runs no more than user_max_running_jobs
    and holds no more than user_max_gpus (one job alone is always allowed: §4, "no cap starves
    a user");
  * FIFO (§4: "FIFO among equals", "among one user's jobs it is FIFO", fair share "FIFO within
    one user"): a job's first start never comes while an older job of the same user, priority
    and size class is still queued and has never started. The size class is what lets a
    younger job pass an older one by design: the GPUs it asks for (a bigger job waits for a
    worker that has them, a smaller one backfills), its GPU memory (one fits a shared GPU the
    other does not) and its time limit (backfill on a reserved worker starts only jobs sure to
    end in time). One exception §4 makes: a job that preempted for its place "starts on that
    worker before anything else", and an older job of its priority that was passed over as too
    big for a worker (or held at a cap) "waits by its enqueue order among those, not by its
    priority", so the preempting job may go first;
  * reservation (§4 backfill: "it starts as soon as its reserved worker has its GPUs"; preemption:
    "the job that asked starts on that worker before anything else"): a claim by the reserved
    worker, when that worker has the head's GPUs free and its user is under the caps, starts
    the head, whenever nothing may go before it (the head preempted for its place, or in a
    FIFO queue nothing else waits at the front, parked, at a cap or with a priority): within
    one claim;
  * ends: every job ends exactly once (one terminal event, the state the model saw it end
    with), the attempt number rises by one at each claim and never otherwise, and at the end of
    an example, every job cancelled or finished, nothing is left anywhere in the queue's keys.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import sys
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import uvloop
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from daemon.job import JobSpec, JobState, Lease, Outcome, RenewStatus
from daemon.queue import keys
from daemon.queue.claims import Capacity
from daemon.queue.connection import AnyRedis
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.worker.gpus import NotEnoughGpus
from tests.support.cluster import ClusterServer
from tests.support.model_worker import GIB, GPU_MEMORY, GRACE, JOBS_PER_GPU, Worker, earliest_ms
from tests.support.queue_places import places
from tests.support.queue_snapshot import Snapshot, leftovers, text

T = TypeVar("T")

# Each example has a queue of its own (no flush between examples, so the model runs on a Cluster too).
QUEUES = itertools.count()
USERS = ("alice", "bob", "carol")
# The workers: name, GPUs, slots. One without GPUs, a small one and a big one, so that jobs are
# passed over (parked), wait for GPUs at the head (reservations) and backfill.
WORKERS = (("cpu", 0, 2), ("small", 2, 2), ("big", 4, 3))
TERMINAL = frozenset(s for s in JobState if s.terminal)

# What the runs did, for the test's report: steps, claims, the checks that had something to check.
STATS: Counter[str] = Counter()


@dataclass
class Job:
    """What the model knows of one job: what it asked for, and what happened to it."""

    id: str
    order: int  # enqueue order in the queue (the model's; Redis's seq follows it)
    spec: JobSpec
    attempt: int = 0  # the last attempt claimed
    started: int | None = None  # the model's start number of its first start
    lease: Lease | None = None  # the lease its worker holds while it runs
    ended: JobState | None = None

    @property
    def size(self) -> tuple[str, int, int, int, float | None]:
        """Who and what it is for FIFO: its user, priority and size class (see the top)."""
        s = self.spec
        return (s.user, s.priority, s.gpus, s.gpu_mem, s.timeout)


# Which job a rule acts on: drawn as a number, whatever the jobs are then (a draw shaped by the
# state, `sampled_from(jobs)`, would make hypothesis see its data generation change between the
# runs of one example when Redis's answers do: fair share ranks by the milliseconds jobs ran).
PICK = st.integers(0, 255)


def picked(pick: int, jobs: list[Job]) -> Job | None:
    return jobs[pick % len(jobs)] if jobs else None


def job_specs() -> st.SearchStrategy[JobSpec]:
    """A job as users submit them: a few users, some priorities, whole GPUs (5: more than any
    worker has) or memory on a shared GPU, with and without a time limit."""
    size = st.one_of(
        st.tuples(st.sampled_from([0, 0, 1, 1, 2, 4, 5]), st.just(0)),
        st.tuples(st.just(0), st.sampled_from([6 * GIB, 12 * GIB])),
    )
    return st.builds(
        lambda user, priority, size, timeout, retries, attempts: JobSpec(
            argv=("true",),
            user=user,
            priority=priority,
            gpus=size[0],
            gpu_mem=size[1],
            timeout=timeout,
            stop_grace=GRACE,
            retries=retries,
            max_attempts=attempts,
        ),
        st.sampled_from(USERS),
        st.sampled_from([0, 0, 0, 10, 50]),
        size,
        st.sampled_from([None, 5.0, 500.0, 500.0]),
        st.sampled_from([0, 0, 1]),
        st.sampled_from([1, 3]),
    )


@dataclass(frozen=True)
class Config:
    """A queue's policies, drawn per example."""

    caps: tuple[int, int]  # user_max_running_jobs, user_max_gpus (0: none)
    fairshare: bool
    preempt: bool
    backoff: float  # retry_backoff (s; 0: a retry goes to the front at once)


CONFIGS = st.builds(
    Config,
    st.sampled_from([(0, 0), (0, 0), (1, 0), (2, 0), (0, 2), (2, 3)]),
    st.booleans(),
    st.booleans(),
    st.sampled_from([0.0, 0.001]),
)

OK = Outcome(JobState.SUCCEEDED, exit_code=0)
FAILED = Outcome(JobState.FAILED, exit_code=1)
CANCELLED = Outcome(JobState.CANCELLED, detail="cancelled")


class SchedulerMachine(RuleBasedStateMachine):
    """The state machine; a test binds `redis` (a client of a Redis of its own: each example has a
    queue of its own there) and `loop` (the event loop the client lives on) in a subclass (`bind`)."""

    redis: ClassVar[AnyRedis]
    loop: ClassVar[asyncio.AbstractEventLoop]

    def __init__(self) -> None:
        super().__init__()
        self.config = Config((0, 0), False, False, 0.0)
        self.name = ""  # the example's queue
        self.queue: JobQueue | None = None
        self.jobs: dict[str, Job] = {}
        self.workers = {name: Worker(name, gpus, slots) for name, gpus, slots in WORKERS}
        self.starts = 0  # first starts so far (FIFO's clock)
        self.broken = False  # a check failed: teardown checks nothing more
        self.snapshot: Snapshot | None = None

    def run(self, coro: Awaitable[T]) -> T:
        return self.loop.run_until_complete(coro)

    @property
    def q(self) -> JobQueue:
        assert self.queue is not None
        return self.queue

    # -- rules --------------------------------------------------------------------------------

    @initialize(config=CONFIGS)
    def configure(self, config: Config) -> None:
        self.config = config
        STATS["examples"] += 1
        self.name = f"model{next(QUEUES)}"
        self.queue = JobQueue(
            self.redis,
            lease_seconds=300,
            user_caps=config.caps,
            fairshare=[self.name] if config.fairshare else [],
            fairshare_half_life=3600.0,
            preempt=[self.name] if config.preempt else [],
            retry_backoff=(config.backoff, config.backoff),
        )

    @rule(specs=st.lists(job_specs(), min_size=1, max_size=2))
    def enqueue(self, specs: list[JobSpec]) -> None:
        specs = [dataclasses.replace(spec, queue=self.name) for spec in specs]
        ids = self.run(self.q.enqueue_many(specs))
        for job_id, spec in zip(ids, specs, strict=True):
            self.jobs[job_id] = Job(job_id, len(self.jobs), spec)
        STATS["enqueued"] += len(ids)

    @rule(pick=PICK, copies=st.integers(1, 2))
    def enqueue_again(self, pick: int, copies: int) -> None:
        """More jobs of a spec enqueued before: jobs of one class, whose order FIFO promises."""
        if job := picked(pick, list(self.jobs.values())):
            self.enqueue([job.spec] * copies)

    @rule(
        user=st.sampled_from(USERS),
        before=st.integers(1, 2),
        after=st.integers(1, 2),
        limits=st.sampled_from([(5.0, 500.0), (500.0, 5.0), (None, 5.0)]),
    )
    def enqueue_a_head_among_small_jobs(
        self, user: str, before: int, after: int, limits: tuple[float | None, float]
    ) -> None:
        """Jobs of one GPU, a job of all the big worker's GPUs, more jobs of one GPU: what makes a
        head wait for GPUs behind running jobs, reserve a worker, and the jobs behind it backfill
        (or not, by their time limits and those of the jobs before it)."""
        first, behind = limits
        head = JobSpec(argv=("true",), user=user, gpus=4, stop_grace=GRACE)
        small = [JobSpec(argv=("true",), user=user, gpus=1, timeout=first, stop_grace=GRACE)] * before
        more = [JobSpec(argv=("true",), user=user, gpus=1, timeout=behind, stop_grace=GRACE)] * after
        self.enqueue([*small, head, *more])

    @rule(name=st.sampled_from([w[0] for w in WORKERS]))
    def claim(self, name: str) -> None:
        """A worker claims for its free slots (a full one only asks whether to preempt)."""
        worker = self.workers[name]
        free = worker.slots - len(worker.held)
        if free == 0:
            if self.config.preempt:
                self.run(self.q.preempt_check(name, [self.name], worker.room(shared=False)))
            return
        head = self.expected_head(worker)
        room = worker.room()
        leases = self.run(self.q.claim_many(name, [self.name], free, room, slots=free))
        STATS["claims"] += 1
        self.check_backfill(worker, room, leases)
        leases.sort(key=lambda lease: not lease.spec.gpu_mem)  # shared ones first, as the dispatcher
        for lease in leases:
            self.started(worker, lease)
        if head is not None:
            STATS["… the head bound to start"] += 1
            assert head in [lease.job_id for lease in leases], (
                f"{name} had the GPUs of the head {head} it is reserved for, under the caps, with "
                f"nothing that may go first, and its claim started {[lease.job_id for lease in leases]}"
            )

    @rule()
    def every_worker_claims(self) -> None:
        """Each worker claims in turn, as idle workers do when jobs come."""
        for name, _gpus, _slots in WORKERS:
            self.claim(name)
            self.consistent()

    @rule()
    def reserved_worker_frees_and_claims(self) -> None:
        """The worker a head is reserved on claims, then ends its attempts one at a time, claiming
        after each: the path on which backfill and the reservation's promise are tested."""
        if (worker := self.reserved_worker()) is None:
            return
        STATS["reserved worker frees"] += 1
        self.claim(worker.name)  # as it is: only jobs sure to end before the head may start
        self.consistent()
        for lease, _slot, _since in list(worker.held.values()):
            self.ended_attempt(self.jobs[lease.job_id], self.run(self.q.complete(lease, OK)))
            self.consistent()
            self.claim(worker.name)
            self.consistent()

    def reserved_worker(self) -> Worker | None:
        name = self.snapshot.reservation.get("worker") if self.snapshot is not None else None
        return self.workers.get(name or "")

    @rule(pick=PICK, failed=st.booleans())
    def complete(self, pick: int, failed: bool) -> None:
        if (job := picked(pick, self.running())) is None:
            return
        assert job.lease is not None
        self.ended_attempt(job, self.run(self.q.complete(job.lease, FAILED if failed else OK)))

    @rule(pick=PICK)
    def cancel(self, pick: int) -> None:
        if (job := picked(pick, self.unended())) is None:
            return
        state = self.run(self.q.cancel(job.id))
        if state == "cancelled":
            job.ended = JobState.CANCELLED
        else:
            assert state == ("cancelling" if job.lease else job.ended), (job.id, state)

    @rule(pick=PICK)
    def requeue(self, pick: int) -> None:
        if (job := picked(pick, self.running())) is None:
            return
        assert self.run(self.q.requeue(job.id)) in ("requeueing", "cancelling")

    @rule(pick=PICK)
    def hand_back(self, pick: int) -> None:
        """A draining worker hands an attempt back (release)."""
        if (job := picked(pick, self.running())) is None:
            return
        assert job.lease is not None
        self.ended_attempt(job, self.run(self.q.hand_back(job.lease)))

    @rule(name=st.sampled_from([w[0] for w in WORKERS]))
    def heartbeat(self, name: str) -> None:
        """A worker renews its leases and does what the answers ask: a cancelled job completes as
        cancelled, a requeued or preempted one is handed back."""
        worker = self.workers[name]
        leases = [lease for lease, _, _ in worker.held.values()]
        if not leases:
            return
        answers = self.run(self.q.renew(name, leases))
        for lease in leases:
            answer = answers[lease.id]
            assert answer is not RenewStatus.LOST, f"{lease.job_id}: {name}'s lease was lost unexpired"
            job = self.jobs[lease.job_id]
            if answer is RenewStatus.CANCEL:
                self.ended_attempt(job, self.run(self.q.complete(lease, CANCELLED)))
            elif answer in (RenewStatus.REQUEUE, RenewStatus.PREEMPT):
                STATS["preempted" if answer is RenewStatus.PREEMPT else "requeued"] += 1
                self.ended_attempt(job, self.run(self.q.hand_back(lease)))

    @rule(pick=PICK)
    def reclaim(self, pick: int) -> None:
        """One attempt's lease runs out (its worker froze) and the reaper takes it back."""
        if (job := picked(pick, self.running())) is None:
            return
        self.run(self.redis.zadd(keys.leases(self.name), {job.id: 0}, xx=True))
        self.reaped(self.run(self.q.reclaim([self.name])))

    @rule(name=st.sampled_from([w[0] for w in WORKERS]))
    def worker_dies(self, name: str) -> None:
        """A worker dies: every lease it held runs out, and so does a reservation it holds."""
        leases = [lease for lease, _, _ in self.workers[name].held.values()]
        if leases:
            self.run(self.redis.zadd(keys.leases(self.name), {lease.job_id: 0 for lease in leases}, xx=True))
        reservation = keys.reservation(self.name)
        if self.run(self.redis.hget(reservation, "worker")) == name.encode():
            self.run(self.redis.hset(reservation, "until", 0))
        self.reaped(self.run(self.q.reclaim([self.name])))

    # -- the model's bookkeeping --------------------------------------------------------------

    def running(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.lease is not None]

    def unended(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.ended is None]

    def holder(self, lease: Lease) -> Worker:
        return self.workers[lease.worker]

    def started(self, worker: Worker, lease: Lease) -> None:
        job = self.jobs[lease.job_id]
        assert job.ended is None, f"{job.id} claimed once {job.ended}"
        assert job.lease is None, f"{job.id} claimed while it runs under {job.lease.id}"
        assert lease.attempt == job.attempt + 1, f"{job.id}: attempt {lease.attempt} after {job.attempt}"
        try:
            worker.take(lease)
        except NotEnoughGpus as exc:
            raise AssertionError(f"{worker.name} was given more than it has: {exc}") from exc
        job.attempt, job.lease = lease.attempt, lease
        if job.started is None:
            self.check_fifo(job)
            job.started = self.starts
            self.starts += 1

    def check_fifo(self, job: Job) -> None:
        """`job` starts for the first time: no older job of its user, priority and size class may
        still be queued and never started (see the top)."""
        snap = self.snapshot
        preempting = snap is not None and snap.reservation.get("preempt") == "1"
        if preempting and snap is not None and snap.reservation.get("job") == job.id:
            return  # the job that preempted goes before anything else (see the top)
        for other in self.jobs.values():
            if other.order < job.order and other.size == job.size:
                STATS["FIFO pairs"] += 1
                assert other.started is not None or other.ended is not None, (
                    f"{job.id} started before {other.id}, older, of the same user, priority and "
                    f"size {job.size}, which is still queued"
                )

    def ended_attempt(self, job: Job, state: JobState) -> None:
        """The worker's attempt of `job` is over (completed, handed back): its slot and GPUs are
        free; the job is queued again or ended, as the script answered."""
        assert job.lease is not None
        self.holder(job.lease).drop(job.lease)
        job.lease = None
        if state in TERMINAL:
            job.ended = state
        else:
            assert state is JobState.QUEUED, (job.id, state)

    def reaped(self, taken: list[tuple[str, JobState]]) -> None:
        for job_id, state in taken:
            job = self.jobs[job_id]
            assert job.lease is not None, f"{job_id} reclaimed while the model has it {job.ended or 'queued'}"
            STATS["reclaimed"] += 1
            self.ended_attempt(job, state)

    # -- the reservation's promise ------------------------------------------------------------

    def expected_head(self, worker: Worker) -> str | None:
        """The head job that `worker`'s claim, about to be made, must start (see the top), or None
        when the promise does not say one must."""
        snap = self.snapshot
        if snap is None or snap.reservation.get("worker") != worker.name:
            return None
        STATS["claims by a reserved worker"] += 1
        head = self.jobs.get(snap.reservation.get("job", ""))
        if head is None or head.ended is not None or head.lease is not None or head.spec.gpu_mem:
            return None
        if int(snap.reservation.get("until", "0")) <= snap.now_ms:
            return None
        STATS["… its reservation live"] += 1
        need = head.spec.gpus or worker.allocator.share
        if need > worker.allocator.free_count() or not snap.under_cap(head.spec.user, need, self.config.caps):
            return None
        STATS["… the head's GPUs free"] += 1
        if snap.reservation.get("preempt") == "1":
            STATS["… the head preempted"] += 1
            return head.id
        if self.config.fairshare:
            return None  # whose turn it is may change from one claim to the next
        first = [
            j for j, found in snap.places.items() if j != head.id and self.goes_first(j, found, worker, snap)
        ]
        return None if first else head.id

    def goes_first(self, job_id: str, found: list[str], worker: Worker, snap: Snapshot) -> bool:
        """Whether a claim of `worker` in a FIFO queue may take this queued job before the head of
        the stream: it is at the front, has a priority, or is parked or held at a cap where this
        worker's claim would take it (claim.lua's order: the front, parked and released jobs by
        seq, then priorities, then the stream)."""
        if not found or found[0] in ("stream", "running", "backoff", "waiting"):
            return False
        if found[0] in ("front", "prio"):
            return True
        spec = self.jobs[job_id].spec
        need = 1 if spec.gpu_mem else spec.gpus or worker.allocator.share
        if spec.gpu_mem and not worker.gpus:
            return False
        if need > worker.gpus:
            return False
        return found[0] == "parked" or snap.under_cap(spec.user, need, self.config.caps)

    def check_backfill(self, worker: Worker, room: Capacity, leases: list[Lease]) -> None:
        """A claim by the worker a head is reserved on, the head still waiting after it: every job it
        started from behind the head (a stream entry enqueued after it) ends before the head could
        start there, by its time limit and stop grace (§4: "nothing started out of order can
        delay the head on its worker"). In a FIFO queue, where "behind" is the enqueue order."""
        if self.config.fairshare or self.snapshot is None or not leases:
            return
        reservation = {
            text(k): text(v) for k, v in self.run(self.redis.hgetall(keys.reservation(self.name))).items()
        }
        head = self.jobs.get(reservation.get("job", ""))
        if reservation.get("worker") != worker.name or head is None or head.ended or head.lease:
            return
        if head.id in [lease.job_id for lease in leases]:
            return
        if self.run(places(self.redis, self.name, [head.id]))[head.id] == ["capped"]:
            return  # held at its user's cap, it is no head: the jobs behind it go on (§4)
        need = 1 if head.spec.gpu_mem else head.spec.gpus or worker.allocator.share
        could_start = earliest_ms(room, need)
        for lease in leases:
            job = self.jobs[lease.job_id]
            if job.order < head.order or self.snapshot.places.get(job.id) != ["stream"]:
                continue
            STATS["jobs backfilled behind a reserved head"] += 1
            t = job.spec.timeout
            limit = math.inf if t is None else round((t + GRACE) * 1000)
            assert limit <= could_start, (
                f"{job.id} (time limit {t}) started on {worker.name} behind {head.id}, reserved "
                f"there, which could start in {could_start} ms"
            )

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if self.queue is None:
            return
        STATS["steps"] += 1
        try:
            self.snapshot = snap = self.run(Snapshot.read(self.redis, self.name, list(self.jobs)))
            if snap.reservation:
                STATS["steps with a reservation"] += 1
            for job in self.jobs.values():
                self.check_job(job, snap)
            self.check_capacity(snap)
            snap.check_caps(self.config.caps)
        except BaseException:
            self.broken = True
            raise

    def check_job(self, job: Job, snap: Snapshot) -> None:
        rec, found = snap.records[job.id], snap.places[job.id]
        state = JobState(rec["state"])
        ends = snap.ends[job.id]
        assert int(rec["attempt"]) == job.attempt, (
            f"{job.id}: attempt {rec['attempt']}, last claimed {job.attempt}"
        )
        if job.ended is not None:
            assert state is job.ended, f"{job.id} ended {job.ended}, its record says {state}"
            assert found == [], f"{job.id} ended {state}, still in {found}"
            assert ends == 1, f"{job.id} ended {state} with {ends} terminal events"
            return
        assert ends == 0, f"{job.id} is {state} with {ends} terminal events"
        assert len(found) == 1, f"{job.id} ({state}) is in {found or 'no place'}"
        if job.lease is None:
            assert state is JobState.QUEUED, f"{job.id}: {state} in {found}, the model has it queued"
            assert found != ["running"], f"{job.id}: queued, with a lease"
        else:
            assert state is JobState.RUNNING, f"{job.id}: {state} in {found}, the model has it running"
            assert found == ["running"], f"{job.id}: running, in {found}"
            assert (rec["worker"], rec["lease"]) == (job.lease.worker, job.lease.id), (job.id, rec)

    def check_capacity(self, snap: Snapshot) -> None:
        for worker in self.workers.values():
            mine = [r for r in snap.records.values() if (r["state"], r["worker"]) == ("running", worker.name)]
            assert len(mine) <= worker.slots, f"{worker.name} runs {len(mine)} jobs on {worker.slots} slots"
            whole = sum(int(r["held_gpus"]) for r in mine if r["gpu_mem_bytes"] == "0")
            shared: dict[str, list[int]] = {}
            for r in mine:
                if r["gpu_mem_bytes"] != "0":
                    shared.setdefault(r["shared_gpu"], []).append(int(r["gpu_mem_bytes"]))
            assert whole + len(shared) <= worker.gpus, f"{worker.name} holds {whole} GPUs and shares {shared}"
            for place, mems in shared.items():
                assert len(mems) <= JOBS_PER_GPU, f"{worker.name}'s GPU {place} runs {len(mems)} jobs"
                assert sum(mems) <= GPU_MEMORY, f"{worker.name}'s GPU {place} shared by {mems} bytes"

    def teardown(self) -> None:
        """Every job cancelled or finished: each ends exactly once, and nothing is left behind."""
        try:
            # (not after a failed step, whose error is the one to report)
            if self.queue is not None and not self.broken and sys.exc_info()[0] is None:
                self.drain()
        finally:
            if self.queue is not None:
                self.run(self.queue.close())

    def drain(self) -> None:
        for job in self.unended():
            if self.run(self.q.cancel(job.id)) == "cancelled":
                job.ended = JobState.CANCELLED
        for job in self.running():
            assert job.lease is not None
            self.ended_attempt(job, self.run(self.q.complete(job.lease, CANCELLED)))
        self.consistent()
        assert all(job.ended is not None for job in self.jobs.values())
        left = self.run(leftovers(self.redis, self.name))
        assert not left, f"keys left with every job ended: {left}"


def bind(redis: AnyRedis, loop: asyncio.AbstractEventLoop) -> type[SchedulerMachine]:
    """The machine, bound to a client and its event loop."""
    return type("BoundSchedulerMachine", (SchedulerMachine,), {"redis": redis, "loop": loop})


def run_machine(server: EmbeddedRedis | ClusterServer, config: settings) -> None:
    """Run the machine against `server` (a redis-server or a Redis Cluster of the test's own)
    under hypothesis `config`, on an event loop of its own (the machine's rules are plain calls,
    each running its queue calls to the end)."""
    loop = uvloop.new_event_loop()
    try:
        redis = server.client()
        try:
            run_state_machine_as_test(bind(redis, loop), settings=config)
        finally:
            loop.run_until_complete(redis.aclose())
    finally:
        loop.close()
