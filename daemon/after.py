"""Dependencies between jobs (`poolctl enqueue --after JOB[:ok|:fail|:any]`): what a job waits for,
and when that is met, or never can be.

A dependency names a job and how it must end: `ok` (succeeded), `fail` (failed, or dead: it ran
and did not succeed) or `any` (ended at all, cancelled included). A job with dependencies is held
out of its queue until every one is met, then joins it at its tail; as soon as one can no longer
be met (the job it waits for ended otherwise), it is cancelled, saying which and why. The server
decides (server/dependencies.py), from the queue's terminal events and a periodic sweep. A
spec's `after` is checked where every field is (spec_checks.py: "JOB:how" each).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from daemon.job import JobState

CONDITIONS = {
    "ok": frozenset({JobState.SUCCEEDED}),
    "fail": frozenset({JobState.FAILED, JobState.DEAD}),
    "any": frozenset(s for s in JobState if s.terminal),
}


def split(dep: str) -> tuple[str, str]:
    job_id, _, how = dep.rpartition(":")
    return job_id, how


def verdict(after: Sequence[str], states: Iterable[JobState | None]) -> tuple[str, str]:
    """('ready', '') when every dependency is met; ('never', why) when one cannot be met any more
    (or its job is gone); ('wait', what) while some job it waits for has not ended."""
    waiting = []
    for dep, state in zip(after, states, strict=True):
        job_id, how = split(dep)
        if state is None:
            return "never", f"the job it waits for, {job_id}, is not in the pool (any more)"
        if not state.terminal:
            waiting.append(
                f"{job_id} to {'succeed' if how == 'ok' else 'fail' if how == 'fail' else 'end'} "
                f"(it is {state})"
            )
        elif state not in CONDITIONS[how]:
            return "never", f"the job it waited for, {job_id}, {state} (it waited for :{how})"
    return ("wait", "waiting for " + ", ".join(waiting)) if waiting else ("ready", "")


def met(after: Sequence[str], states: Iterable[JobState | None]) -> list[str]:
    """The dependencies of `after` that are met (their job ended as asked), in order."""
    return [
        dep
        for dep, state in zip(after, states, strict=True)
        if state is not None and state in CONDITIONS[split(dep)[1]]
    ]
