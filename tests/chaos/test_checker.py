"""The checker itself can fail: fed a history that breaks a guarantee, it says so."""

from __future__ import annotations

from daemon.job import Attempt, JobInfo, JobSpec, JobState
from tests.chaos.checker import Span, Verdict, check_fifo, check_overlaps


def info(job_id: str, seq: int, started: float) -> JobInfo:
    return JobInfo(
        id=job_id,
        state=JobState.SUCCEEDED,
        spec=JobSpec(argv=("true",)),
        seq=seq,
        attempt=1,
        worker="w",
        enqueued_at=0,
        started_at=started,
        ended_at=started + 1,
        exit_code=0,
        detail="",
        cancel_requested=False,
        attempts=(Attempt(1, "w", started, started + 1, "succeeded"),),
    )


def test_overlapping_attempts_are_caught() -> None:
    v = Verdict()
    spans = [Span("j", 1, "host-100-aa", 10.0, 12.0), Span("j", 2, "host-200-bb", 11.0, 13.0)]
    check_overlaps(v, spans, killed={})
    assert v.overlaps == 1


def test_an_attempt_without_end_counts_only_when_its_worker_was_killed() -> None:
    v = Verdict()
    spans = [Span("j", 1, "host-100-aa", 10.0), Span("j", 2, "host-200-bb", 11.0, 13.0)]
    check_overlaps(v, spans, killed={100: 10.5})  # died at 10.5, before attempt 2 started: fine
    assert (v.overlaps, v.unknown_ends) == (0, 0)
    v = Verdict()
    check_overlaps(v, [Span("k", 1, "host-300-cc", 10.0)], killed={})
    assert v.unknown_ends == 1


def test_fifo_violation_is_caught() -> None:
    v = Verdict()
    check_fifo(v, [info("a", 1, 5.0), info("b", 2, 4.0), info("c", 3, 6.0)])
    assert v.fifo_violations == 1
    assert not v.ok
