"""The checker itself can fail: fed a history that breaks a guarantee, it says so."""

from __future__ import annotations

import dataclasses

from daemon.job import Attempt, JobInfo, JobSpec, JobState
from tests.chaos.checker import Span, Verdict, check_ends, check_fifo, check_overlaps, check_terminal


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
    spans = [
        Span("j", 1, "a/1.1", "host-100-aa", 10.0, 12.0),
        Span("j", 2, "b/1.1", "host-200-bb", 11.0, 13.0),
    ]
    check_overlaps(v, spans, killed={})
    assert v.overlaps == 1


def test_an_attempt_killed_while_running_lived_until_its_last_tick() -> None:
    v = Verdict()
    killed = Span("j", 1, "a/1.1", "host-100-aa", 10.0, last_seen=10.5)  # SIGKILLed worker at 10.6
    frozen = Span("k", 1, "c/1.1", "host-300-cc", 10.0, last_seen=11.0)  # its guard killed it
    after = [
        Span("j", 2, "b/1.1", "host-200-bb", 10.7, 13.0),
        Span("k", 2, "d/1.1", "host-200-bb", 11.2, 12.0),
    ]
    check_overlaps(v, [killed, frozen, *after], killed={100: 10.6})
    assert (v.overlaps, v.guard_kills) == (0, 1)
    v = Verdict()
    still_alive = Span("k", 1, "c/1.1", "host-300-cc", 10.0, last_seen=11.0)
    check_overlaps(v, [still_alive, Span("k", 2, "d/1.1", "host-200-bb", 10.9, 12.0)], killed={})
    assert v.overlaps == 1  # attempt 2 began while attempt 1 still ticked


def test_an_outcome_from_an_attempt_that_never_ended_is_caught() -> None:
    v = Verdict()
    job = info("j", 1, 5.0)
    never_ended = Span("j", 1, "a/1.1", "host-100-aa", 5.0)
    check_ends(v, {"j": dataclasses.replace(job, lease="a/1.1")}, {"a/1.1": never_ended})
    assert v.unknown_ends == 1
    assert not v.ok


def test_only_submissions_a_rollback_took_away_may_vanish() -> None:
    v = Verdict()
    found = check_terminal(v, {"a": None, "b": None}, {"a": 10.5, "b": 20.0}, rollbacks=[(10.0, 11.0)])
    # b was acknowledged long after the rollback: losing it breaks the promise
    assert (found, v.rolled_back, v.lost) == ({}, 1, 1)


def test_fifo_violation_is_caught() -> None:
    v = Verdict()
    check_fifo(v, [info("a", 1, 5.0), info("b", 2, 4.0), info("c", 3, 6.0)])
    assert v.fifo_violations == 1
    assert not v.ok
