"""The history checker: after the faults, drain the pool and verify every guarantee, Jepsen-style.

Inputs: the ids the clients were given, the ledger the jobs wrote, the fault log, and the pool's
own records in Redis. Each check returns its count so the test (and `make chaos`) can print them.
The workflow features' rules (dependencies, arrays, checkpoints, webhooks) are in
tests/chaos/workflow_rules.py; what the checks read and say, in tests/chaos/history.py.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from typing import cast

from redis.exceptions import RedisError

from daemon.errors import JobNotFound
from daemon.job import JobInfo, JobState
from daemon.queue import keys, registry
from daemon.queue.job_queue import JobQueue
from daemon.queue.reads import _s, xrange
from tests.chaos import workflow_rules
from tests.chaos.harness import TICK, Cluster
from tests.chaos.history import Span, Verdict, read_ledger

SLACK = 0.05  # seconds a tick may come late on a busy machine
ACK_LATENCY = 2.0  # seconds a client may take to hear that its job was written


async def drain(queue: JobQueue, ids: list[str], limit: float) -> dict[str, JobInfo | None]:
    """Wait until every id is terminal or gone (or `limit` seconds pass); the final records."""
    deadline = time.monotonic() + limit
    while True:
        infos: dict[str, JobInfo | None] = {}
        try:
            for i in ids:
                try:
                    infos[i] = await queue.get(i)
                except JobNotFound:
                    infos[i] = None
        except RedisError:
            # The last fault may have been a failover still under way (the sentinels name no
            # primary for a moment): the judge waits for the pool as a client would, and a pool
            # that never comes back fails the run with Redis's own error.
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.25)
            continue
        if all(info is None or info.state.terminal for info in infos.values()) or time.monotonic() > deadline:
            return infos
        await asyncio.sleep(0.25)


async def check(
    cluster: Cluster,
    queue: JobQueue,
    acked: dict[str, float],
    limit: float = 120,
    workflows: workflow_rules.WorkflowRun | None = None,
) -> Verdict:
    """`acked`: every job id a client was given, with when it was given; `workflows`: what the
    workflow units submitted and the receiver got, for their rules."""
    v = Verdict(jobs=len(acked))
    infos = await drain(queue, list(acked), limit)
    expected = workflow_rules.expected_ends(infos, workflows.submitted.fails) if workflows else {}
    unended = await explain_unended(queue, infos)
    found = check_terminal(v, infos, acked, cluster.faults.rollbacks, expected, unended)
    await check_unexpected(v, queue, set(acked))
    await check_counts(v, queue)
    await check_results_once(v, queue, found)
    spans = read_ledger(cluster.ledger)
    v.attempts_run = len(spans)
    killed = {w.proc.pid: w.killed_at for w in cluster.workers if w.killed_at}
    check_overlaps(v, list(spans.values()), killed)
    check_ends(v, found, spans)
    check_fifo(v, list(found.values()), policies=cluster.policies)
    if workflows is not None:
        pilots = {w.proc.pid for w in cluster.workers if w.kind == "pilot"}
        v.pilot_attempts = sum(1 for s in spans.values() if _pid_of(s.worker) in pilots)
        await workflow_rules.check(v, found, infos, spans, workflows)
    v.problems += [f"fault at {when:.3f}: {what}" for when, what in cluster.faults.log]
    return v


async def explain_unended(queue: JobQueue, infos: Mapping[str, JobInfo | None]) -> dict[str, str]:
    """Why each job not ended yet may still be under way, for the ones that may: running under a
    live lease of a live worker, or held for a job that is itself under way so. A job left out
    has no such reason: it is lost."""
    open_jobs = {i: info for i, info in infos.items() if info is not None and not info.state.terminal}
    if not open_jobs:
        return {}
    alive = {w["id"] for w in await registry.list_workers(queue.redis) if w.get("health") != "dead"}
    now_ms = time.time() * 1000
    reasons: dict[str, str] = {}
    for job_id, info in open_jobs.items():
        if info.state == JobState.RUNNING:
            deadline = await queue.redis.zscore(keys.leases(info.spec.queue), job_id)
            if deadline is not None and deadline > now_ms and info.worker in alive:
                reasons[job_id] = f"running on {info.worker} (attempt {info.attempt}), its lease live"
    for _ in range(len(open_jobs)):  # a chain of held jobs, a link at a time
        for job_id, info in open_jobs.items():
            under_way = [dep for dep, _, _ in (d.rpartition(":") for d in info.spec.after) if dep in reasons]
            if job_id not in reasons and info.state == JobState.QUEUED and under_way:
                reasons[job_id] = f"waiting for {under_way[0]}, still under way"
    return reasons


def check_terminal(  # noqa: PLR0917
    v: Verdict,
    infos: dict[str, JobInfo | None],
    acked: dict[str, float],
    rollbacks: list[tuple[float, float]],
    expected: Mapping[str, frozenset[JobState]] | None = None,
    unended: Mapping[str, str] | None = None,
) -> dict[str, JobInfo]:
    """lost = 0: every id a client was given reached a terminal state, but those submitted while
    Redis was writing what a rollback then took away, and those still under way for a reason
    (`unended`: still running, reported). wrong ends = 0: each ended as `expected` says (succeeded
    when it says nothing). The jobs found."""
    found: dict[str, JobInfo] = {}
    for job_id, info in infos.items():
        if info is None:
            # written after the copy, before the kill; its reply may come a little after the kill
            if any(copied <= acked[job_id] <= killed + ACK_LATENCY for copied, killed in rollbacks):
                v.rolled_back += 1
            else:
                v.lost += 1
                v.problems.append(f"{job_id} vanished")
            continue
        found[job_id] = info
        must = (expected or {}).get(job_id, frozenset({JobState.SUCCEEDED}))
        if not info.state.terminal and job_id in (unended or {}):
            v.still_running += 1
            v.problems.append(f"{job_id} still under way: {(unended or {})[job_id]}")
        elif not info.state.terminal:
            v.lost += 1
            v.problems.append(f"{job_id} never ended: {info.state}, and nothing it waits for is under way")
        elif info.state not in must:
            v.wrong_ends += 1
            v.problems.append(f"{job_id} ended {info.state} ({info.detail}), not {'/'.join(sorted(must))}")
        if len(info.attempts) > 1:
            v.reclaimed_jobs += 1
    return found


async def check_unexpected(v: Verdict, queue: JobQueue, known: set[str]) -> None:
    """unexpected = 0: the pool holds no job that no client was given."""
    for q in await queue.queues():
        members = cast(list[bytes], await queue.redis.zrange(keys.jobs(q), 0, -1))
        for job_id in (m.decode() for m in members):
            if job_id not in known:
                v.unexpected += 1
                idem, enqueued = await queue.redis.hmget(keys.job(job_id), ["idem", "enqueued_at"])
                v.problems.append(
                    f"{job_id} is in the pool but no client was given it (key {idem!r}, at {enqueued!r})"
                )


async def check_counts(v: Verdict, queue: JobQueue) -> None:
    """miscounted = 0: what each user has not ended in each queue, as the scripts count it
    (lib/finish.lua `unended`, by which user_max_queued_jobs is kept), is what the records say, after
    every fault: the jobs counted ('counted') that are queued or running."""
    for q in await queue.queues():
        records: Counter[str] = Counter()
        for member in cast(list[bytes], await queue.redis.zrange(keys.jobs(q), 0, -1)):
            record = keys.job(member.decode())
            state, user, counted = await queue.redis.hmget(record, ["state", "user", "counted"])
            if counted == b"1" and state in (b"queued", b"running"):
                records[_s(user or b"")] += 1
        kept = {_s(u): int(n) for u, n in (await queue.redis.hgetall(keys.unended(q))).items()}
        if kept != dict(records):
            v.miscounted += 1
            v.problems.append(f"queue {q}: unended jobs counted {kept}, the records say {dict(records)}")


async def check_results_once(v: Verdict, queue: JobQueue, infos: dict[str, JobInfo]) -> None:
    """results not once = 0, by each job's terminal events and history (`check_decided`)."""
    events: dict[str, int] = defaultdict(int)
    for q in await queue.queues():
        for _, fields in await xrange(queue.redis, keys.events(q), "-"):
            events[fields[b"job"].decode()] += 1
    for job_id, info in infos.items():
        if info.state.terminal:
            check_decided(v, job_id, info, events[job_id])


def check_decided(v: Verdict, job_id: str, info: JobInfo, events: int) -> None:
    """One terminal event for an ended job, and one attempt that decided its end: every other one
    was lost, handed back, or failed with a retry left (at most `retries` of those, each before
    the one that decided). A job never started (cancelled while it waited) has none."""
    finished = [a for a in info.attempts if a.how not in ("lost", "released", "running")]
    retried = finished[:-1]
    decided = 0 if info.state == JobState.CANCELLED and not info.attempts else 1
    if (
        events != 1
        or len(finished) - len(retried) != decided
        or any(a.how != "failed" for a in retried)
        or len(retried) > info.spec.retries
    ):
        v.results_not_once += 1
        v.problems.append(
            f"{job_id}: {events} terminal events, finished attempts "
            f"{[a.how for a in finished]} ({info.spec.retries} retries)"
        )


def check_overlaps(v: Verdict, spans: list[Span], killed: dict[int, float]) -> None:
    """No two attempts of one job ran at the same time. An attempt killed before its end (no `end`
    line) was alive until its last line, and at most until TICK (plus scheduling slack) after it;
    one whose worker was SIGKILLed died then (its orphan guard kills within ms)."""
    by_job: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        if span.end is None:
            died = killed.get(_pid_of(span.worker))
            if died is None:
                v.guard_kills += 1  # killed while running: by its worker's fence, or its guard
            span.end = min(died, span.last_seen + TICK + SLACK) if died else span.last_seen + TICK + SLACK
            span.estimated = True
        by_job[span.job].append(span)
    for job_id, job_spans in by_job.items():
        job_spans.sort(key=lambda s: s.start)
        for a, b in itertools.pairwise(job_spans):
            if a.end is not None and b.start < a.end:
                v.overlaps += 1
                v.problems.append(
                    f"{job_id}: attempt {a.attempt} ({a.start:.3f}-{a.end:.3f}, {a.lease}) overlaps "
                    f"attempt {b.attempt} ({b.start:.3f}, {b.lease})"
                )


def check_ends(v: Verdict, infos: dict[str, JobInfo], spans: dict[str, Span]) -> None:
    """unknown ends = 0: every recorded outcome comes from an attempt whose process ran to its end."""
    for job_id, info in infos.items():
        span = spans.get(info.lease)
        ran_to_end = span is not None and span.end is not None and not span.stopped and span.job == job_id
        if info.state == "succeeded" and not ran_to_end:
            v.unknown_ends += 1
            v.problems.append(f"{job_id}: succeeded by lease {info.lease}, which never ran to its end")


def check_fifo(v: Verdict, infos: list[JobInfo], *, policies: bool = False) -> None:
    """Jobs never reclaimed were claimed in enqueue order (claim times are Redis server time);
    with the scheduling policies on, in enqueue order among one user's jobs of one priority (fair
    share and priorities reorder the rest, by their rules). Order holds among the jobs every
    worker of a queue could run alike: one line per queue, priority, GPU request and time limit
    (a pilot passes over a job that could outlive it; a job too big to start waits while smaller
    ones backfill). A job held out of its queue (dependencies, an array's window) joins it when
    its turn comes, at its tail: it is in no line."""
    lines: dict[tuple[object, ...], list[JobInfo]] = {}
    for i in infos:
        s = i.spec
        if len(i.attempts) == 1 and not s.held:
            line = (s.queue, s.priority, s.gpus, s.gpu_mem, s.timeout, s.stop_grace)
            lines.setdefault((*line, s.user) if policies else line, []).append(i)
    for same in lines.values():
        for a, b in itertools.pairwise(sorted(same, key=lambda i: i.seq)):
            if a.attempts[0].started_at > b.attempts[0].started_at:
                v.fifo_violations += 1
                v.problems.append(f"{b.id} (seq {b.seq}) started before {a.id} (seq {a.seq})")


def _pid_of(worker_id: str) -> int:
    """Worker ids are HOST-PID-RANDOM; the harness knows its worker processes by pid."""
    parts = worker_id.rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else -1
