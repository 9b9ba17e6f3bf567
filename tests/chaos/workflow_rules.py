"""The checker's rules for the workflow features (tests/chaos/workflows.py submits them), each a count
in the Verdict (tests/chaos/history.py), each shown to fail on a history that breaks it
(tests/chaos/test_checker.py):

- how each job must end (`expected_ends`): a job made to fail, failed; a dependent whose
  dependencies all ended as asked, as its own kind; one whose dependency ended otherwise, or
  vanished with Redis's lost writes, cancelled; the rest, succeeded (checker.check_terminal counts
  the others as wrong ends, and a job not ended at all as lost unless it is still under way);
- dependencies (`check_dependents`): every attempt of a dependent the pool counts started after
  each job it waits for had ended as asked (its recorded end), and a dependent whose dependency
  was not met never started; it ran to a recorded success at most once (checker's results once);
  a submission the server refused names a dependency that vanished;
- arrays (`check_windows`): no more of an array's jobs ran at once, by the ledger's spans, than its
  `%N`;
- GPUs (`check_gpus`): at no moment does a GPU held whole by a job have another job on it, nor
  do the `--gpu-mem` jobs sharing a GPU declare more than its memory or number more than
  `gpu_max_jobs`, by the GPUs each attempt was given (CUDA_VISIBLE_DEVICES) and its ledger span;
- checkpoints (`check_restores`): a save an attempt found at its start is its own job's, from an
  attempt that started before it, and, for an attempt the job's history counts, from an earlier
  attempt that history counts too (never a forgotten execution's);
- webhooks (`check_hooks`): every end owed a delivery (the job's `--notify`, the pool's
  `notify_url`) reached the receiver, signed (the pool's with the pool's key, the job's own with
  its user's), saying the job's end; duplicates are counted apart
  (allowed after faults, as docs/GUARANTEES.md says).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import orjson

from daemon.job import JobInfo, JobState
from daemon.webhook import DELIVERY_HEADER, TARGET_JOB, TARGET_POOL
from tests.chaos.harness import GPU_MAX_JOBS, GPU_QUEUE, GPU_SIZES
from tests.chaos.history import Span, Verdict
from tests.chaos.workflows import Submitted
from tests.support.webhooks import Post, signed

GPU_MEMORY = int(float(GPU_SIZES.split(",")[0]) * 2**30)  # bytes of each made-up GPU (all alike)
MET = {
    "ok": frozenset({JobState.SUCCEEDED}),
    "fail": frozenset({JobState.FAILED, JobState.DEAD}),
    "any": frozenset(s for s in JobState if s.terminal),
}


@dataclass
class WorkflowRun:
    """What the checker needs beside the pool's records: what was submitted, what the receiver
    got, the keys it checks signatures with (the pool's; each user's, for jobs' own hooks), whether
    the pool notifies every end (`notify_url`), and how long to wait for deliveries still owed."""

    submitted: Submitted
    posts: list[Post]
    secret: str
    pool_notify: bool
    user_keys: Mapping[str, bytes] = field(default_factory=dict)
    hook_wait: float = 60.0


def met(dep: str, infos: Mapping[str, JobInfo | None]) -> bool | None:
    """Whether dependency "JOB:how" is met by its job's final state: None while it has not ended;
    False when it vanished or ended otherwise."""
    job_id, _, how = dep.rpartition(":")
    info = infos.get(job_id)
    if info is None:
        return False
    if not info.state.terminal:
        return None
    return info.state in MET[how]


def expected_ends(infos: Mapping[str, JobInfo | None], fails: set[str]) -> dict[str, frozenset[JobState]]:
    """How each job found must end (module docstring)."""
    out: dict[str, frozenset[JobState]] = {}
    for job_id, info in infos.items():
        if info is None:
            continue
        if any(met(dep, infos) is False for dep in info.spec.after):
            out[job_id] = frozenset({JobState.CANCELLED})
        else:
            out[job_id] = frozenset({JobState.FAILED if job_id in fails else JobState.SUCCEEDED})
    return out


async def check(
    v: Verdict,
    found: dict[str, JobInfo],
    infos: Mapping[str, JobInfo | None],
    spans: dict[str, Span],
    run: WorkflowRun,
) -> None:
    """Every workflow rule, in turn (the spans' ends as checker.check_overlaps set them)."""
    by_job: dict[str, list[Span]] = defaultdict(list)
    for span in spans.values():
        by_job[span.job].append(span)
    check_dependents(v, found, infos, by_job)
    check_refusals(v, run.submitted, infos)
    check_windows(v, found, list(spans.values()))
    check_gpus(v, list(spans.values()), GPU_MEMORY, GPU_MAX_JOBS)
    check_restores(v, found, spans)
    gpu_jobs = {i for i, info in found.items() if info.spec.queue == GPU_QUEUE}
    v.preempted = sum(1 for s in spans.values() if s.stopped and s.job in gpu_jobs)
    await wait_for_hooks(found, run)
    check_hooks(v, found, run)


def check_dependents(
    v: Verdict, found: dict[str, JobInfo], infos: Mapping[str, JobInfo | None], by_job: dict[str, list[Span]]
) -> None:
    """early starts = 0, unmet runs = 0 (module docstring)."""
    for job_id, info in found.items():
        if not info.spec.after:
            continue
        v.dependents += 1
        verdicts = [met(dep, infos) for dep in info.spec.after]
        if False in verdicts:
            for span in by_job.get(job_id, []):
                v.unmet_runs += 1
                v.problems.append(f"{job_id} ran ({span.lease}) though {info.spec.after} was not met")
            continue
        counted = {a.lease for a in info.attempts}
        for span in by_job.get(job_id, []):
            if span.lease not in counted:
                continue  # an execution Redis forgot (it lost its last writes): no release it knew
            for dep in info.spec.after:
                ended = infos[dep.rpartition(":")[0]]
                if ended is None or ended.ended_at is None or span.start <= ended.ended_at:
                    v.early_starts += 1
                    v.problems.append(
                        f"{job_id} started at {span.start:.3f} ({span.lease}), before {dep} had ended "
                        f"({ended.ended_at if ended else None})"
                    )


def check_refusals(v: Verdict, submitted: Submitted, infos: Mapping[str, JobInfo | None]) -> None:
    """wrong refusals = 0: a refused submission waited for a job that vanished."""
    for key, deps in submitted.refused.items():
        if not any(infos.get(dep) is None for dep in deps):
            v.wrong_refusals += 1
            v.problems.append(f"{key} was refused though every job it waits for ({deps}) is in the pool")


def check_windows(v: Verdict, found: dict[str, JobInfo], spans: list[Span]) -> None:
    """window excess = 0: at no moment more of an array's jobs running than its window."""
    limits = {i.spec.array: i.spec.array_limit for i in found.values() if i.spec.array}
    v.arrays = len(limits)
    moments: dict[str, list[tuple[float, int, str]]] = defaultdict(list)
    for span in spans:
        if span.array and span.end is not None:
            moments[span.array] += [(span.start, 1, span.lease), (span.end, -1, span.lease)]
    for array, events in moments.items():
        window = limits.get(array, 0)
        running: set[str] = set()
        for at, step, lease in sorted(events, key=lambda e: (e[0], e[1])):  # an end before a start
            if step < 0:
                running.discard(lease)
                continue
            running.add(lease)
            if window and len(running) > window:
                v.window_excess += 1
                v.problems.append(f"array {array} ran {len(running)} at {at:.3f}, over its %{window}")
            v.most_under_way = max(v.most_under_way, len(running) if window else 0)


def check_gpus(v: Verdict, spans: list[Span], memory: int, max_jobs: int) -> None:
    """GPUs over-committed = 0 (module docstring): each GPU has `memory` bytes and takes at most
    `max_jobs` shared jobs. An attempt killed before it wrote its end (SIGKILL: by its worker's
    fence, a lost lease) is counted on its GPU until its last line, when it was surely alive: its
    worker frees the GPU once its processes have ended, which may be within the tick after it, and
    the next job there may start at once (checker.check_overlaps' bound for one job's attempts,
    a tick past the last line, would count that as sharing)."""
    moments: dict[str, list[tuple[float, int, Span]]] = defaultdict(list)
    for span in spans:
        if not span.gpus or span.end is None:
            continue
        v.gpu_attempts += 1
        v.shared_attempts += bool(span.mem)
        end = span.last_seen if span.estimated else span.end
        if end <= span.start:
            continue  # (killed as it started: alive at one instant only, with no time on the GPU)
        for uuid in span.gpus.split(","):
            moments[uuid] += [(span.start, 1, span), (end, -1, span)]
    for uuid, events in moments.items():
        on: dict[str, Span] = {}
        for at, step, span in sorted(events, key=lambda e: (e[0], e[1])):  # an end before a start
            if step < 0:
                on.pop(span.lease, None)
                continue
            on[span.lease] = span
            shared = [s for s in on.values() if s.mem]
            declared = sum(int(s.mem) for s in shared)
            if len(shared) < len(on) > 1 or declared > memory or len(shared) > max_jobs:
                v.gpu_overcommit += 1
                v.problems.append(
                    f"GPU {uuid} at {at:.3f}: {len(on) - len(shared)} whole-GPU and {len(shared)} shared "
                    f"jobs, {declared / 2**30:g} GiB declared ({', '.join(sorted(on))})"
                )


def check_restores(v: Verdict, found: dict[str, JobInfo], spans: dict[str, Span]) -> None:
    """bad restores = 0 (module docstring)."""
    for span in spans.values():
        if not span.restored:
            continue
        v.restores += 1
        job, _, lease = span.restored.partition(",")
        source = spans.get(lease)
        info = found.get(span.job)
        history = [a.lease for a in info.attempts] if info else []
        why = ""
        if job != span.job:
            why = "another job's save"
        elif source is None or source.job != span.job or source.start >= span.start or lease == span.lease:
            why = "no earlier attempt of the job saved it"
        elif span.lease in history and (
            lease not in history or history.index(lease) > history.index(span.lease)
        ):
            why = "a save of an attempt its history does not count before it"
        if why:
            v.bad_restores += 1
            v.problems.append(f"{span.job} attempt {span.lease} restored {span.restored}: {why}")


def owed(found: dict[str, JobInfo], pool_notify: bool) -> set[str]:
    """The deliveries owed ("JOB/TARGET"): each ended job's, to the pool's URL and its own."""
    out = set()
    for job_id, info in found.items():
        if info.state.terminal:
            if pool_notify:
                out.add(f"{job_id}/{TARGET_POOL}")
            if info.spec.notify:
                out.add(f"{job_id}/{TARGET_JOB}")
    return out


async def wait_for_hooks(found: dict[str, JobInfo], run: WorkflowRun) -> None:
    """Let the pool deliver what it still owes, up to `run.hook_wait` seconds (a bound)."""
    due = owed(found, run.pool_notify)
    deadline = time.monotonic() + run.hook_wait
    while due - {p.headers.get(DELIVERY_HEADER, "") for p in run.posts} and time.monotonic() < deadline:
        await asyncio.sleep(0.2)


def check_hooks(v: Verdict, found: dict[str, JobInfo], run: WorkflowRun) -> None:
    """hooks missing = 0, hooks bad = 0 (module docstring); duplicates counted."""
    due = owed(found, run.pool_notify)
    v.notified = len(due)
    got: dict[str, list[Post]] = defaultdict(list)
    for post in run.posts:
        delivery = post.headers.get(DELIVERY_HEADER, "")
        got[delivery].append(post)
        job_id, _, target = delivery.rpartition("/")
        owner = found[job_id].spec.user if job_id in found else ""
        key = run.user_keys.get(owner, b"") if target == TARGET_JOB else run.secret.encode()
        if not signed(post, key):
            whose = f"{owner}'s" if target == TARGET_JOB else "the pool's"
            v.hooks_bad += 1
            v.problems.append(f"a POST for {delivery} is not signed with {whose} key")
    for delivery in sorted(due):
        posts = got.get(delivery, [])
        if not posts:
            v.hooks_missing += 1
            v.problems.append(f"{delivery}: its end was never delivered")
            continue
        v.hook_duplicates += len(posts) - 1
        state = found[delivery.rpartition("/")[0]].state
        if all(orjson.loads(p.body).get("state") != state for p in posts):
            v.hooks_bad += 1
            v.problems.append(f"{delivery}: no delivery says it ended {state}")
