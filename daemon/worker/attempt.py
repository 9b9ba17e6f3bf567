"""An attempt a worker holds: one record from its claim to the moment its end is recorded.

The worker keeps its attempts in one map, keyed by lease id (never by job id: a job reclaimed from
under this worker may be claimed by it again while its old attempt is still being killed, and
after Redis lost its last writes the two may even share an attempt number). Each record carries
what the worker knows of its attempt: the lease, the run (its processes), its slot, where it is in
its life (`Phase`), and `deadline`, the moment until which its lease surely holds.

The deadline is the self-fence. A lease outlives the renewal (or claim) that set it by the lease
length, counted from when Redis ran it, which is after the worker sent it. So `sent + lease`, by
the worker's own clock, is a time before which no other worker can have the attempt; less a margin
for clock rates, that is `deadline`. It is set at the claim, moved on by every renewal that
answers OK, and never by anything else: an attempt whose renewals fail is killed at its deadline
by the worker (dispatcher.py) and, should the worker be frozen, by its orphan guard (orphan_guard.py),
which holds the same deadlines. The clock is CLOCK_BOOTTIME, which, unlike the monotonic clock,
goes on while the machine is suspended: a suspended worker's leases expire in Redis meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from daemon.job import Lease, RenewStatus
from daemon.worker.gpu_usage import GpuUsage
from daemon.worker.idle_gpus import IdleWatch
from daemon.worker.orphan_guard import OrphanGuard
from daemon.worker.run_types import Run

log = logging.getLogger(__name__)

FENCE_CHECK = 0.5  # the fence's waits run on the monotonic clock: after a suspend, look again soon


def boottime() -> float:
    """Seconds on CLOCK_BOOTTIME: monotonic, and counting the time the machine was suspended."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class Phase(enum.Enum):
    CLAIMED = "claimed"  # held, renewed, not started yet
    RUNNING = "running"  # its processes may run: the fence kills them at the deadline
    ENDING = "ending"  # its processes are gone: its outcome (or hand-back) is being recorded


@dataclass(eq=False)
class HeldAttempt:
    lease: Lease
    deadline: float  # boottime() until which the lease surely holds
    phase: Phase = Phase.CLAIMED
    run: Run | None = None
    slot: int | None = None
    task: asyncio.Task[None] | None = None
    fenced: bool = False  # killed at its deadline already
    since: float = field(default_factory=boottime)  # boottime() of its claim
    usage: GpuUsage | None = None  # what its GPUs did so far (gpu_watch.py), if it holds any
    idle: IdleWatch | None = None  # how long they have been idle, if it holds any and flags are on
    # The last write of its idle record (gpu_watch.py), which its end's record waits for
    idle_record: asyncio.Task[None] | None = None

    def expired(self) -> bool:
        """Past the deadline: the lease may be another worker's by now."""
        return boottime() >= self.deadline

    def renewed(self, until: float) -> bool:
        """A renewal answered OK: the lease holds until `until` at least. True if that moved the
        deadline (a late answer to an older renewal does not move it back)."""
        if until <= self.deadline:
            return False
        self.deadline = until
        return True


def latest_ends(
    held: Iterable[HeldAttempt], gpus_of: Callable[[str], int], grace: float
) -> list[tuple[float | None, int]]:
    """When each attempt holding GPUs ends at the latest, in seconds from now (its time limit from
    its claim, plus its stop grace, else `grace`; None: no limit), with its GPUs (`gpus_of` its
    lease id): what a claim's backfill needs to know of when a head job could start (claim.lua)."""
    now = boottime()
    out: list[tuple[float | None, int]] = []
    for h in held:
        spec = h.lease.spec
        if gpus := gpus_of(h.lease.id):
            stop_grace = grace if spec.stop_grace is None else spec.stop_grace
            left = None if spec.timeout is None else max(0.0, h.since + spec.timeout + stop_grace - now)
            out.append((left, gpus))
    return out


class Holdings:
    """Every attempt a worker holds, by lease id; the answers of its renewals applied to them; and
    the fence, which kills each running attempt whose deadline passes. The orphan guard is told
    every deadline as it moves, so it can do the same for a frozen worker."""

    def __init__(self, guard: OrphanGuard) -> None:
        self.guard = guard
        self._by_lease: dict[str, HeldAttempt] = {}
        # The fence looks at least every FENCE_CHECK while anything runs, and a deadline only moves
        # later: it needs waking only when an attempt starts whose deadline comes before its next
        # look (a claim answered late has one that soon; with nothing running it looks at none).
        self._started = asyncio.Event()
        self._next_look = math.inf  # boottime() of the fence's next look
        self._changed_at = boottime()  # the last hold or drop: how long an empty map has been empty

    def __iter__(self) -> Iterator[HeldAttempt]:
        return iter(list(self._by_lease.values()))

    def hold(self, lease: Lease, deadline: float) -> HeldAttempt:
        held = self._by_lease[lease.id] = HeldAttempt(lease, deadline)
        self._changed_at = boottime()
        return held

    def quiet_for(self) -> float:
        """Seconds since the last attempt was dropped, while none is held; 0.0 while one is."""
        return 0.0 if self._by_lease else boottime() - self._changed_at

    def get(self, lease_id: str) -> HeldAttempt | None:
        return self._by_lease.get(lease_id)

    def holds(self, held: HeldAttempt) -> bool:
        return self._by_lease.get(held.lease.id) is held

    def started(self, held: HeldAttempt, run: Run, slot: int) -> None:
        """Its processes may start now: from here the fence (and the guard) watch its deadline.
        One whose deadline has passed already (its claim was answered late: Redis was slow, or its
        answer was) is lost here, before the caller spawns anything: its lease may be another
        worker's by now, and it goes back to its queue when the lease lapses in Redis."""
        held.run, held.slot, held.phase = run, slot, Phase.RUNNING
        self.guard.hold(held.lease.id, held.deadline)
        if held.expired():
            log.warning(
                "job %s attempt %d: its claim was answered after its lease's deadline; not started",
                held.lease.job_id,
                held.lease.attempt,
            )
            run.lose("its claim was answered after its lease's deadline")
            held.fenced = True
        elif held.deadline < self._next_look:
            self._started.set()

    def drop(self, held: HeldAttempt) -> None:
        """Its end is recorded (or given up on): no more renewals, no more deadline."""
        if self.holds(held):
            del self._by_lease[held.lease.id]
            self._changed_at = boottime()
        self.guard.drop(held.lease.id)

    def renewed(self, statuses: Mapping[str, RenewStatus], until: float) -> None:
        """One heartbeat's answers, by lease id (heartbeat.py); the OK ones hold until `until`."""
        for lease_id, status in statuses.items():
            held = self._by_lease.get(lease_id)
            if held is None:
                continue  # ended meanwhile
            if status is RenewStatus.LOST:
                if held.run is not None:
                    held.run.lose("the lease was lost (this worker was presumed dead, or the job ended)")
                elif held.phase is Phase.CLAIMED:
                    self.drop(held)  # never started, and now never will
                continue
            if held.run is not None and held.run.exited:
                continue  # its processes are gone: its deadline stays where the end found it
            if held.renewed(until):
                self.guard.hold(lease_id, until)
            if status is RenewStatus.CANCEL and held.run is not None:
                held.run.cancel()
            elif status is RenewStatus.REQUEUE and held.run is not None:
                held.run.hand_back(why="requeued by its user")
            elif status is RenewStatus.PREEMPT and held.run is not None:
                held.run.hand_back(why="preempted by a job of higher priority")

    async def fence(self, reason: str) -> None:
        """Kill every running attempt whose deadline passes, until cancelled: its lease may be
        another worker's by then. An attempt whose processes have ended is never touched: its
        outcome is still offered, and the fenced complete decides."""
        while True:
            self._started.clear()
            now = boottime()
            running = [h for h in self if h.phase is Phase.RUNNING and not h.fenced]
            due = [h for h in running if h.deadline <= now]
            if due:
                log.error("killing %d running jobs: %s", len(due), reason)
            for h in due:
                assert h.run is not None
                h.run.lose(reason)
                h.fenced = True
            left = [h.deadline - now for h in running if not h.fenced]
            timeout = min(FENCE_CHECK, max(0.0, min(left))) if left else None
            self._next_look = math.inf if timeout is None else now + timeout
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._started.wait()
