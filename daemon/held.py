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
by the worker (worker.py) and, should the worker be frozen, by its orphan guard (procguard.py),
which holds the same deadlines. The clock is CLOCK_BOOTTIME, which, unlike the monotonic clock,
goes on while the machine is suspended: a suspended worker's leases expire in Redis meanwhile.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass

from daemon.job import Lease
from daemon.runner import Run


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
