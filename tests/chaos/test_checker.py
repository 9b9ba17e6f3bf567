"""The checker itself can fail: fed a history that breaks a guarantee, it says so."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import orjson

from daemon.job import Attempt, JobInfo, JobSpec, JobState
from daemon.queue import keys
from daemon.queue.job_queue import JobQueue
from daemon.webhook import DELIVERY_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from tests.chaos import workflow_rules
from tests.chaos.checker import (
    check_counts,
    check_decided,
    check_ends,
    check_fifo,
    check_overlaps,
    check_terminal,
    explain_unended,
)
from tests.chaos.history import Span, Verdict
from tests.chaos.workflow_rules import WorkflowRun
from tests.chaos.workflows import Submitted
from tests.support.webhooks import Post
from tests.support.workers import running_worker, sh, wait_state


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


# -- the workflow rules (tests/chaos/workflow_rules.py), issue 43 --------------------------------------


def job(
    job_id: str, state: JobState = JobState.SUCCEEDED, *leases: str, ended: float = 2.0, **spec: Any
) -> JobInfo:
    """A job record: its spec's fields as given, its attempts those `leases` (the last decided)."""
    attempts = tuple(
        Attempt(n, "w", 1.0, ended, "released" if n < len(leases) else str(state), lease)
        for n, lease in enumerate(leases, 1)
    )
    return dataclasses.replace(
        info(job_id, 1, 1.0),
        state=state,
        spec=JobSpec(argv=("true",), **spec),
        ended_at=ended,
        attempts=attempts,
        lease=leases[-1] if leases else "",
    )


def test_a_job_not_ended_is_lost_unless_something_keeps_it_under_way() -> None:
    """issue 43, chaos: every accepted job ends, or is still running at the end with a reason."""
    v = Verdict()
    running = job("r", JobState.RUNNING, "a/1.1")
    queued = job("q", JobState.QUEUED)
    check_terminal(v, {"r": running, "q": queued}, {"r": 1.0, "q": 1.0}, [], unended={"r": "running on w"})
    assert (v.still_running, v.lost) == (1, 1)
    assert not v.ok
    v = Verdict()
    check_terminal(v, {"r": running}, {"r": 1.0}, [], unended={"r": "running on w"})
    assert (v.still_running, v.lost, v.ok) == (1, 0, True)


async def test_what_keeps_a_job_under_way_is_read_from_the_pool(queue: JobQueue, tmp_path: Path) -> None:
    """issue 43, chaos: a job not ended may be running under a live lease of a live worker, or held
    for such a job; one queued where no worker serves has no such reason (it is lost)."""
    async with running_worker(queue, tmp_path / "w"):
        long, _ = await queue.enqueue(sh("sleep 30"))
        held, _ = await queue.enqueue(sh("true", after=(f"{long}:ok",)))
        stuck, _ = await queue.enqueue(sh("true", queue="nobody"))
        await wait_state(queue, long, JobState.RUNNING)
        infos: dict[str, JobInfo | None] = {i: await queue.get(i) for i in (long, held, stuck)}
        reasons = await explain_unended(queue, infos)
    assert set(reasons) == {long, held}, reasons
    assert "running on" in reasons[long]
    assert long in reasons[held]


def test_a_dependent_ends_as_what_it_waits_for_allows() -> None:
    """issue 43, chaos: a job made to fail fails; a dependent of a dependency not met (or gone) is
    cancelled, not run; one whose dependencies are met runs."""
    infos: dict[str, JobInfo | None] = {
        "f": job("f", JobState.FAILED, "f/1"),
        "g": job("g", JobState.SUCCEEDED, "g/1", after=("f:ok",)),  # ran, though f failed
        "h": job("h", JobState.SUCCEEDED, "h/1", after=("f:fail",)),
        "k": job("k", JobState.CANCELLED, after=("gone:any",)),
        "gone": None,
    }
    expected = workflow_rules.expected_ends(infos, fails={"f"})
    assert expected["g"] == expected["k"] == {JobState.CANCELLED}
    assert expected["f"] == {JobState.FAILED}
    assert expected["h"] == {JobState.SUCCEEDED}
    v = Verdict()
    check_terminal(v, infos, dict.fromkeys(infos, 1.0), [], expected)
    assert v.wrong_ends == 1  # g
    found = {i: x for i, x in infos.items() if x is not None}
    workflow_rules.check_dependents(v, found, infos, {"g": [Span("g", 1, "g/1", "w", 3.0, 4.0)]})
    assert (v.dependents, v.unmet_runs, v.early_starts) == (3, 1, 0)


def test_a_dependent_that_started_before_its_dependency_ended_is_caught() -> None:
    """issue 43, chaos: every dependent started only after each job it waits for had ended as asked
    (an execution Redis forgot, in no history, is not held to it)."""
    infos: dict[str, JobInfo | None] = {
        "a": job("a", JobState.SUCCEEDED, "a/1", ended=10.0),
        "b": job("b", JobState.SUCCEEDED, "b/1", "b/2", after=("a:ok",)),
    }
    found = {i: x for i, x in infos.items() if x is not None}
    forgotten = Span("b", 1, "b/0", "w", 9.0, 9.5)  # claimed, then Redis lost the claim
    on_time = Span("b", 2, "b/2", "w", 10.5, 11.0)
    v = Verdict()
    workflow_rules.check_dependents(v, found, infos, {"b": [forgotten, on_time]})
    assert (v.early_starts, v.ok) == (0, True)
    early = Span("b", 1, "b/1", "w", 9.9, 10.2)
    workflow_rules.check_dependents(v, found, infos, {"b": [early, on_time]})
    assert v.early_starts == 1
    assert not v.ok


def test_a_refusal_stands_only_for_a_dependency_that_vanished() -> None:
    """issue 43, chaos: a submission refused for what it waits for names a job Redis lost."""
    submitted = Submitted(refused={"k1": ["gone"], "k2": ["here"]})
    v = Verdict()
    workflow_rules.check_refusals(v, submitted, {"gone": None, "here": job("here")})
    assert v.wrong_refusals == 1
    assert not v.ok


def test_an_array_running_more_than_its_window_is_caught() -> None:
    """issue 43, chaos: no array has more than N of its jobs running at once (by the spans)."""
    found = {i: job(i, array="default@a1", array_limit=2) for i in "xyz"}
    spans = [
        Span("x", 1, "x/1", "w", 1.0, 2.0, array="default@a1"),
        Span("y", 1, "y/1", "w", 1.5, 3.0, array="default@a1"),
        Span("z", 1, "z/1", "w", 2.0, 3.5, array="default@a1"),  # starts as x ends: 2 at once
    ]
    v = Verdict()
    workflow_rules.check_windows(v, found, spans)
    assert (v.arrays, v.most_under_way, v.window_excess) == (1, 2, 0)
    spans[2].start = 1.9
    workflow_rules.check_windows(v, found, spans)
    assert (v.most_under_way, v.window_excess) == (3, 1)
    assert not v.ok


def test_a_restored_save_must_be_an_earlier_counted_attempt_of_the_same_job() -> None:
    """issue 43, chaos: a restored checkpoint came from an earlier attempt of the same job whose
    history counts: no other job's, no later attempt's, no execution Redis forgot."""
    found = {"j": job("j", JobState.SUCCEEDED, "j/1", "j/3"), "o": job("o", JobState.SUCCEEDED, "o/1")}
    first = Span("j", 1, "j/1", "w", 1.0, 2.0)
    forgotten = Span("j", 2, "j/2", "w", 2.5, 3.0)  # Redis lost its claim: in no history
    other = Span("o", 1, "o/1", "w", 0.5, 1.0)
    good = Span("j", 3, "j/3", "w", 3.5, 4.0, restored="j,j/1")
    v = Verdict()
    workflow_rules.check_restores(v, found, {s.lease: s for s in (first, forgotten, other, good)})
    assert (v.restores, v.bad_restores) == (1, 0)
    for bad in ("o,o/1", "j,j/2", "j,j/9"):  # another job's; a forgotten execution's; none that ran
        v = Verdict()
        late = dataclasses.replace(good, restored=bad)
        workflow_rules.check_restores(v, found, {s.lease: s for s in (first, forgotten, other, late)})
        assert v.bad_restores == 1, bad
    future = dataclasses.replace(first, restored="j,j/3")  # the first attempt found the third's save
    v = Verdict()
    workflow_rules.check_restores(v, found, {s.lease: s for s in (future, good)})
    assert v.bad_restores == 1
    assert not v.ok


def post(delivery: str, state: str, secret: str) -> Post:
    body = orjson.dumps({"event": "job.ended", "id": delivery.partition("/")[0], "state": state})
    now = int(time.time())
    headers = {DELIVERY_HEADER: delivery, TIMESTAMP_HEADER: str(now)}
    return Post({**headers, SIGNATURE_HEADER: sign(secret.encode(), now, body)}, body, 200)


def test_every_end_owed_a_webhook_must_reach_the_receiver_signed() -> None:
    """issue 43, chaos: every job with a notify target was delivered at least once (duplicates
    counted apart, allowed), signed, saying how it ended."""
    found = {"a": job("a", notify="http://127.0.0.1:1/h", user="alice"), "b": job("b")}
    secret = "k"
    posts = [post("a/job", "succeeded", "alice's key"), post("a/pool", "succeeded", secret)]
    posts += [post("b/pool", "succeeded", secret), post("b/pool", "succeeded", secret)]
    run = WorkflowRun(Submitted(), posts, secret, pool_notify=True, user_keys={"alice": b"alice's key"})
    v = Verdict()
    workflow_rules.check_hooks(v, found, run)
    assert (v.notified, v.hooks_missing, v.hook_duplicates, v.hooks_bad, v.ok) == (3, 0, 1, 0, True)
    run.posts = posts[1:]  # a/job never came
    v = Verdict()
    workflow_rules.check_hooks(v, found, run)
    assert (v.hooks_missing, v.ok) == (1, False)
    run.posts = [*posts[:3], post("b/pool", "failed", secret)]
    run.posts[0] = post("a/job", "succeeded", secret)  # the pool's key, not alice's
    v = Verdict()
    workflow_rules.check_hooks(v, found, run)
    assert v.hooks_bad == 1  # a/job not signed with alice's key; b/pool said succeeded once, which is its end
    assert not v.ok


def test_a_gpu_shared_beyond_its_means_is_caught() -> None:
    """issue 43, chaos: a GPU held whole is never shared, and jobs sharing one stay within its
    memory and its job cap."""
    gib = 2**30
    shared = [Span(f"m{i}", 1, f"m/{i}", "w", 1.0 + i, 5.0, gpus="G0", mem=str(30 * gib)) for i in range(2)]
    v = Verdict()
    workflow_rules.check_gpus(v, [*shared, Span("w", 1, "w/1", "w", 5.0, 6.0, gpus="G0")], 80 * gib, 3)
    assert (v.gpu_attempts, v.shared_attempts, v.gpu_overcommit) == (3, 2, 0)
    third = Span("m3", 1, "m/3", "w", 3.5, 4.0, gpus="G0", mem=str(30 * gib))  # 90 GiB on an 80
    whole = Span("w", 1, "w/1", "w", 4.5, 6.0, gpus="G0")  # a whole-GPU job beside two shared
    for extra in (third, whole):
        v = Verdict()
        workflow_rules.check_gpus(v, [*shared, extra], 80 * gib, 3)
        assert v.gpu_overcommit == 1
        assert not v.ok
    v = Verdict()
    small = [dataclasses.replace(s, mem=str(gib)) for s in [*shared, third]]
    workflow_rules.check_gpus(v, small, 80 * gib, 2)  # three on a GPU that takes two
    assert v.gpu_overcommit == 1


def test_a_gpu_job_killed_before_its_end_line_holds_its_gpu_until_its_last_line() -> None:
    """issue 43, chaos: a job killed before it wrote its end (SIGKILL) is counted on its GPU until
    its last line, when it was surely alive, not the tick after it that bounds one job's attempts:
    its worker may free the GPU, and start the next job there, within that tick."""
    killed = Span("a", 1, "a/1", "w", 1.0, 1.1, last_seen=1.0, gpus="G0", estimated=True)
    after = Span("b", 1, "b/1", "w", 1.05, 2.0, gpus="G0")
    v = Verdict()
    workflow_rules.check_gpus(v, [killed, after], 80 * 2**30, 3)
    assert v.gpu_overcommit == 0
    alive = dataclasses.replace(killed, last_seen=1.06)  # it wrote a line after b started there
    v = Verdict()
    workflow_rules.check_gpus(v, [alive, after], 80 * 2**30, 3)
    assert v.gpu_overcommit == 1
    assert not v.ok


def test_retries_before_the_decided_attempt_are_not_a_second_result() -> None:
    """issue 43, chaos: a job that failed and was retried has one decided attempt; more failed
    attempts than its retries is a result more than once."""
    retried = dataclasses.replace(
        job("r", JobState.SUCCEEDED, retries=1),
        attempts=(Attempt(1, "w", 1.0, 2.0, "failed", "r/1"), Attempt(2, "w", 3.0, 4.0, "succeeded", "r/2")),
    )
    v = Verdict()
    check_decided(v, "r", retried, events=1)
    assert v.results_not_once == 0
    check_decided(v, "r", dataclasses.replace(retried, spec=JobSpec(argv=("true",))), events=1)
    assert v.results_not_once == 1
    never_ran = job("c", JobState.CANCELLED, after=("x:ok",))
    v = Verdict()
    check_decided(v, "c", never_ran, events=1)
    assert v.results_not_once == 0


def test_a_job_held_for_its_turn_is_in_no_fifo_line_but_the_others_still_are() -> None:
    """issue 43, chaos: a dependent joins its queue's tail when released, after jobs enqueued
    later; jobs of one line (queue, priority, GPUs, time limit) still start in order."""
    held = dataclasses.replace(info("d", 1, 9.0), spec=JobSpec(argv=("true",), after=("x:ok",)))
    v = Verdict()
    check_fifo(v, [held, info("a", 2, 5.0), info("b", 3, 6.0)])
    assert v.fifo_violations == 0
    timed = dataclasses.replace(info("t", 4, 1.0), spec=JobSpec(argv=("true",), timeout=4.0))
    check_fifo(v, [timed, info("a", 2, 5.0), info("b", 3, 6.0)])  # another line: a pilot took it
    assert v.fifo_violations == 0
    check_fifo(v, [info("a", 2, 5.0), info("b", 3, 4.0)])
    assert v.fifo_violations == 1


async def test_a_users_count_of_jobs_not_ended_that_drifted_is_caught(queue: JobQueue) -> None:
    """issue 44 item 6: the count user_max_queued_jobs is kept by must be what the records say."""
    first, _ = await queue.enqueue(JobSpec(argv=("true",), user="alice"))
    await queue.enqueue(JobSpec(argv=("true",), user="alice"))
    await queue.cancel(first)
    v = Verdict()
    await check_counts(v, queue)
    assert v.miscounted == 0, v.problems
    await queue.redis.hincrby(keys.unended("default"), "alice", 1)  # as a lost decrement would
    await check_counts(v, queue)
    assert v.miscounted == 1
    assert "counted {'alice': 2}, the records say {'alice': 1}" in v.problems[0]
