"""The attempts a worker holds and its self-fence (daemon/worker/attempt.py `Holdings`): each
running attempt is killed when its deadline passes, whatever the other attempts' deadlines."""

from __future__ import annotations

import asyncio

import pytest

from daemon.job import JobSpec, Lease
from daemon.worker import attempt
from daemon.worker.attempt import Holdings, boottime
from daemon.worker.gpus import GpuInfo
from daemon.worker.orphan_guard import OrphanGuard
from daemon.worker.run_types import Ending, RunResult


class NotedRun:
    """A run that only notes when it was lost (the Run protocol; the fence asks nothing else)."""

    def __init__(self, job: str) -> None:
        self.lease = Lease(job, 1, "w", JobSpec(argv=("true",)), f"w/{job}.0")
        self.gpus: tuple[GpuInfo, ...] = ()
        self.exited = False
        self.lost_at: float | None = None

    def start(self) -> None:
        pass

    async def run(self) -> RunResult:
        return RunResult(Ending.LOST, None)

    async def tidy(self) -> None:
        pass

    @property
    def stopping(self) -> bool:
        return self.exited

    def cancel(self) -> None:
        pass

    def hand_back(self, now: bool = False, why: str = "", by_policy: bool = False) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def lose(self, why: str) -> None:
        if self.lost_at is None:
            self.lost_at = boottime()


async def test_an_attempt_started_with_an_earlier_deadline_is_fenced_at_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 43, found by the chaos suite (its workflow run, seed 19): the fence, asleep until the
    next deadline of the attempts it watched, was woken for a new one only when it watched none;
    an attempt started with a deadline before that look ran on past it (and past its lease in
    Redis). Here the fence watches an attempt due in a minute, then one due in a moment starts:
    it is killed at its deadline, not at the other's."""
    monkeypatch.setattr(attempt, "FENCE_CHECK", 60.0)  # the fence looks no sooner than a deadline
    holdings = Holdings(OrphanGuard("test"))
    fence = asyncio.create_task(holdings.fence("no lease renewal"))
    try:
        later, soon = NotedRun("later"), NotedRun("soon")
        holdings.started(holdings.hold(later.lease, boottime() + 60), later, 0)
        await asyncio.sleep(0.05)  # the fence has looked, and sleeps until `later` is due
        due = boottime() + 0.3
        holdings.started(holdings.hold(soon.lease, due), soon, 1)
        async with asyncio.timeout(30):  # a bound: without the wake, the fence sleeps a minute
            while soon.lost_at is None:
                await asyncio.sleep(0.02)
        assert soon.lost_at >= due
        assert later.lost_at is None
    finally:
        fence.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fence


async def test_an_attempt_whose_deadline_passed_before_its_start_is_lost_before_it_spawns() -> None:
    """Issue 43, chaos: an attempt whose claim was answered after its deadline is lost as it is
    handed its slot, before its caller spawns anything (test_worker_faults.py has the same through a
    real worker and a late claim)."""
    holdings = Holdings(OrphanGuard("test"))
    late = NotedRun("late")
    holdings.started(holdings.hold(late.lease, boottime() - 0.1), late, 0)
    assert late.lost_at is not None
    on_time = NotedRun("on-time")
    holdings.started(holdings.hold(on_time.lease, boottime() + 30), on_time, 1)
    assert on_time.lost_at is None
