"""The GPU-less fast path, the worker's part: every mechanism of the worker that exists only for
short jobs on workers without GPUs, behind one switch (`fast_path` in the config, carried by the
worker's JobQueue; queue/fast_path.py is the queue's part). The dispatcher asks `FastPath` what
to do and never checks itself whether it has GPUs. With the switch off a worker claims only for
its free slots, waits for work without a claim standing, records each outcome as it comes, and
spawns each job from its attempt's task once its slot's directories are reset: the plain path,
what a GPU worker always does, and what the tests check the fast path against.

The mechanisms:

- Look-ahead (`LookAhead`): jobs claimed before a slot is free, while this worker's jobs are
  short. A slot that claims only once it is free waits a round trip to Redis between two jobs,
  which a local queue does not: at two slots of millisecond jobs that round trip is what keeps a
  worker from the speed of the machine. So while every slot is taken and the last job to end here
  ran less than `below` seconds, the dispatcher claims DEPTH jobs more in one claim and keeps them
  here; each slot that frees starts the oldest at once, and once none is left the next claim
  travels while they run: one claim, and one round trip, for every DEPTH jobs. No slot waits for
  that claim, so it does not go ahead of the other script calls, alone, as a claim for a free slot
  does: it rides in the batch of its turn, with the outcome of the job that just ended
  (`claim_many(urgent=False)`).
- Lingering outcomes (`FastPath.linger`): while short jobs flow and another runs here, an outcome
  may wait up to LINGER for the next one (queue/fast_path.py `Pipeliner`), or for the next claim:
  the ends of several jobs then share one write, and one wake of Redis, which are most of what
  recording a short job's end costs both sides. It changes when an outcome is recorded, by at
  most LINGER, never what is recorded nor under which lease.
- The standing claim (`FastPath.stands`): an idle worker leaves its next claim with its JobQueue,
  for the next enqueue through it to send (work_watch.py, queue/fast_path.py `Standing`).
- Eager start and hand-over (`FastPath.eager`): a job that needs nothing fetched is spawned in the
  turn that freed its slot or got its claim (runner.py `JobRun.start`), and a job that changed
  none of its directories and holds no GPUs frees its slot before its end is recorded
  (runner.py `_hand_over`). They save a turn of the loop, and a reset of the directories, between
  one short job and the next.

What the guarantees keep (docs/GUARANTEES.md, 4):
- each is claimed as any job is: from the head of its queue at the time (FIFO), under a lease
  the heartbeat renews with the others, counted towards its user's caps, reclaimed if this
  worker dies; on this worker it starts before any job claimed after it;
- none waits long behind a job that is not short: once the oldest has not started within `hold`
  seconds, those kept are handed back to the front of their queue (hand_back.lua: a hand-back,
  never a failure), and the worker looks ahead again only once a short job has ended here. A
  worker of long jobs never looks ahead, and one whose jobs turn long hands back at most DEPTH
  jobs, once;
- one cancelled, requeued or preempted while it waits is handed back (hand_back.lua ends a
  cancelled one cancelled); a draining worker hands them back first, as they never started;
- only on a worker without GPUs (`FastPath.begin`). There a claim never waits for GPUs, so a
  look-ahead claim can neither reserve the worker for a head job (backfill) nor ask a running job to make room
  (preemption); on a GPU worker a job takes seconds to start on its GPUs, and a round trip is
  nothing beside that.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from daemon.job import Lease
from daemon.queue.job_queue import JobQueue
from daemon.worker.attempt import HeldAttempt, Holdings, boottime
from daemon.worker.gpus import GpuInfo

log = logging.getLogger(__name__)

BELOW = 0.05  # a job that ran less than this (seconds) is short: look ahead after it
HOLD = 0.25  # the longest a job claimed ahead waits for a slot here before it is handed back
DEPTH = 2  # jobs claimed ahead in one claim, once none is kept
LINGER = 0.002  # the longest an outcome waits for company while short jobs flow (seconds)


class FastPath:
    """What the fast path does on one worker: on (the switch) and, from `begin`, whether the
    worker has no GPUs. The dispatcher asks it, never the switch nor its GPUs."""

    def __init__(self, on: bool, held: Holdings, *, below: float = BELOW, hold: float = HOLD) -> None:
        self.on = on
        self.look_ahead = LookAhead(held, below=below, hold=hold)
        self._gpuless = False

    def begin(self, gpus: Sequence[GpuInfo]) -> None:
        """The worker's GPUs are known (at its start): look-ahead and the standing claim serve only
        a worker without any."""
        self._gpuless = not gpus
        self.look_ahead.enabled = self.on and self._gpuless

    def stands(self) -> bool:
        """Whether the worker leaves its next claim standing while it waits for work (a GPU
        worker's claim carries NVML's readings of free memory, which would age while it stands)."""
        return self.on and self._gpuless

    @property
    def eager(self) -> bool:
        """Whether a job is spawned in the turn that freed its slot or got its claim, and a slot
        handed over before its job's end is recorded (runner.py). Each checks for itself that the
        job allows it (nothing to fetch, no GPUs held, its directories unchanged)."""
        return self.on

    def linger(self, busy: int) -> float:
        """Seconds an outcome may wait for company: LINGER while short jobs flow and `busy` slots
        (another job) run here, whose end comes soon; else none."""
        return LINGER if self.look_ahead.flowing() and busy else 0.0

    def say_started(self, queue: JobQueue, lease: Lease) -> None:
        """A job claimed ahead of a free slot starts now (`say_started`)."""
        say_started(queue, lease, self.look_ahead.flowing())


class LookAhead:
    """The attempts claimed ahead of a free slot (at most DEPTH), in claim order, and whether the
    worker looks ahead now. They are held in `held` (renewed by the heartbeat) all the while."""

    def __init__(self, held: Holdings, *, below: float = BELOW, hold: float = HOLD) -> None:
        self.below, self.hold = below, hold
        self.enabled = False  # set by FastPath.begin, on a worker without GPUs
        self._held = held
        self._kept: collections.deque[HeldAttempt] = collections.deque()
        self._short = False  # the last job to end here ran less than `below`

    def __len__(self) -> int:
        return len(self._kept)

    def flowing(self) -> bool:
        """Short jobs flow here: looking ahead, the last job to end ran less than `below`."""
        return self.enabled and self._short

    def wanted(self) -> int:
        """How many jobs to claim ahead now: DEPTH while looking ahead and none is kept, else 0."""
        return DEPTH if self.flowing() and not self._kept else 0

    def keep(self, held: HeldAttempt) -> None:
        self._kept.append(held)

    def ended(self, ran: float) -> None:
        """A job ended here after `ran` seconds: look ahead after it if it was short."""
        self._short = ran < self.below

    def next(self) -> HeldAttempt | None:
        """The oldest attempt kept that may still start here (its lease surely holds), no longer
        kept nor held: the caller starts it. Ones whose lease may have lapsed are let go: Redis
        gives them to another worker when their leases expire."""
        while self._kept:
            held = self._kept.popleft()
            valid = self._held.holds(held) and not held.expired()
            self._held.drop(held)
            if valid:
                return held
        return None

    def due_in(self) -> float | None:
        """Seconds until the oldest attempt kept has waited `hold`; None when none is kept."""
        return max(0.0, self._kept[0].since + self.hold - boottime()) if self._kept else None

    def give_up(self, lease_ids: Iterable[str] | None = None) -> list[HeldAttempt]:
        """The attempts kept (those of `lease_ids`, or all), no longer kept nor held, for the
        caller to hand back (hand_back.lua is fenced: one whose lease lapsed meanwhile is left as
        Redis has it). Giving up all of them (they waited too long, or the worker drains)
        also stops looking ahead until the next short job."""
        ids = None if lease_ids is None else set(lease_ids)
        out = [h for h in self._kept if ids is None or h.lease.id in ids]
        if ids is None:
            self._short = False
        for held in out:
            self._kept.remove(held)
            self._held.drop(held)
        return out


def say_started(queue: JobQueue, lease: Lease, flowing: bool) -> None:
    """A job claimed ahead of a free slot (`lease.ahead`) starts now: Redis is told, in this
    turn's batch (with the outcome of the job whose slot it takes, lingering as that does while
    short jobs flow), so that from now its attempt counts as run (started.lua)."""
    queue.mark_started(lease, linger=LINGER if flowing else 0.0).add_done_callback(_said)


def _said(marked: asyncio.Future[Any]) -> None:
    """The answer to a start's mark. One refused or lost leaves the attempt counted as never
    started: taken back from this worker, should it die, as a hand-back rather than a loss, the
    one thing it costs."""
    if not marked.cancelled() and (exc := marked.exception()) is not None:
        log.warning(
            "a job's start could not be recorded (%s): taken back, it would count as never started", exc
        )
