"""The history checker: after the faults, drain the pool and verify every guarantee, Jepsen-style.

Inputs: the ids the clients were given, the ledger the jobs wrote, the fault log, and the pool's
own records in Redis. Each check returns its count so the test (and `make chaos`) can print them.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from redis.exceptions import RedisError

from daemon.errors import JobNotFound
from daemon.job import JobInfo
from daemon.queue import keys
from daemon.queue.job_queue import JobQueue
from daemon.queue.reads import xrange
from tests.chaos.harness import TICK, Cluster

SLACK = 0.05  # seconds a tick may come late on a busy machine
ACK_LATENCY = 2.0  # seconds a client may take to hear that its job was written


@dataclass
class Span:
    """One attempt's life as its job wrote it: keyed by its lease id, which never repeats."""

    job: str
    attempt: int
    lease: str
    worker: str
    start: float
    end: float | None = None
    last_seen: float = 0.0  # its last line (a tick, at most TICK apart while it lives)
    stopped: bool = False  # it ended on SIGTERM (handed back: a requeue, a preemption, a drain)


@dataclass
class Verdict:
    jobs: int = 0
    lost: int = 0
    rolled_back: int = 0  # ids whose submission Redis lost with its last writes (documented)
    unexpected: int = 0
    not_succeeded: int = 0
    results_not_once: int = 0
    overlaps: int = 0
    guard_kills: int = 0  # attempts killed while running, not by a worker's SIGKILL
    unknown_ends: int = 0
    fifo_violations: int = 0
    reclaimed_jobs: int = 0
    attempts_run: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.unexpected
            or self.not_succeeded
            or self.results_not_once
            or self.overlaps
            or self.unknown_ends
            or self.fifo_violations
        )


def read_ledger(path: Path) -> dict[str, Span]:
    spans: dict[str, Span] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) != 6:
            continue
        job, attempt, lease, worker, what, micros = parts
        at = int(micros) / 1e6
        if what == "start":
            spans[lease] = Span(job, int(attempt), lease, worker, at, last_seen=at)
        elif lease in spans:
            spans[lease].last_seen = at
            if what in {"end", "stopped"}:
                spans[lease].end = at
                spans[lease].stopped = what == "stopped"
    return spans


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


async def check(cluster: Cluster, queue: JobQueue, acked: dict[str, float], limit: float = 120) -> Verdict:
    """`acked`: every job id a client was given, with when it was given."""
    v = Verdict(jobs=len(acked))
    infos = await drain(queue, list(acked), limit)
    found = check_terminal(v, infos, acked, cluster.faults.rollbacks)
    await check_unexpected(v, queue, set(acked))
    await check_results_once(v, queue, found)
    spans = read_ledger(cluster.ledger)
    v.attempts_run = len(spans)
    killed = {w.proc.pid: w.killed_at for w in cluster.workers if w.killed_at}
    check_overlaps(v, list(spans.values()), killed)
    check_ends(v, found, spans)
    check_fifo(v, list(found.values()), policies=cluster.policies)
    v.problems += [f"fault at {when:.3f}: {what}" for when, what in cluster.faults.log]
    return v


def check_terminal(
    v: Verdict,
    infos: dict[str, JobInfo | None],
    acked: dict[str, float],
    rollbacks: list[tuple[float, float]],
) -> dict[str, JobInfo]:
    """lost = 0: every id a client was given reached a terminal state (and, here, success), but
    those submitted while Redis was writing what a rollback then took away. The jobs found."""
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
        if not info.state.terminal:
            v.lost += 1
            v.problems.append(f"{job_id} never ended: {info.state}")
        elif info.state != "succeeded":
            v.not_succeeded += 1
            v.problems.append(f"{job_id} ended {info.state}: {info.detail}")
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


async def check_results_once(v: Verdict, queue: JobQueue, infos: dict[str, JobInfo]) -> None:
    """One terminal event per job, and one attempt that ended other than lost or handed back."""
    events: dict[str, int] = defaultdict(int)
    for q in await queue.queues():
        for _, fields in await xrange(queue.redis, keys.events(q), "-"):
            events[fields[b"job"].decode()] += 1
    for job_id, info in infos.items():
        finished = [a for a in info.attempts if a.how not in ("lost", "released", "running")]
        if events[job_id] != 1 or len(finished) != 1:
            v.results_not_once += 1
            v.problems.append(
                f"{job_id}: {events[job_id]} terminal events, {len(finished)} finished attempts"
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
    share and priorities reorder the rest, by their rules)."""
    lines: dict[tuple[str, int], list[JobInfo]] = {}
    for i in infos:
        if len(i.attempts) == 1:
            lines.setdefault((i.spec.user, i.spec.priority) if policies else ("", 0), []).append(i)
    for line in lines.values():
        for a, b in itertools.pairwise(sorted(line, key=lambda i: i.seq)):
            if a.attempts[0].started_at > b.attempts[0].started_at:
                v.fifo_violations += 1
                v.problems.append(f"{b.id} (seq {b.seq}) started before {a.id} (seq {a.seq})")


def _pid_of(worker_id: str) -> int:
    """Worker ids are HOST-PID-RANDOM; the harness knows its worker processes by pid."""
    parts = worker_id.rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else -1
