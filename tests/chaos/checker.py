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

from daemon import keys
from daemon.job import JobInfo
from daemon.queue import JobQueue, xrange
from tests.chaos.harness import Cluster


@dataclass
class Span:
    job: str
    attempt: int
    worker: str
    start: float
    end: float | None = None


@dataclass
class Verdict:
    jobs: int = 0
    lost: int = 0
    unexpected: int = 0
    not_succeeded: int = 0
    results_not_once: int = 0
    overlaps: int = 0
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


def read_ledger(path: Path) -> dict[tuple[str, int], Span]:
    spans: dict[tuple[str, int], Span] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) != 5:
            continue
        job, attempt, worker, what, ns = parts
        key = (job, int(attempt))
        if what == "start":
            spans[key] = Span(job, int(attempt), worker, int(ns) / 1e9)
        elif key in spans:
            spans[key].end = int(ns) / 1e9
    return spans


async def drain(queue: JobQueue, ids: list[str], limit: float) -> dict[str, JobInfo]:
    """Wait until every id is terminal (or `limit` seconds pass); the final records."""
    deadline = time.monotonic() + limit
    while True:
        infos = {i: await queue.get(i) for i in ids}
        if all(info.state.terminal for info in infos.values()) or time.monotonic() > deadline:
            return infos
        await asyncio.sleep(0.25)


async def check(cluster: Cluster, queue: JobQueue, ids: list[str], limit: float = 120) -> Verdict:
    v = Verdict(jobs=len(ids))
    infos = await drain(queue, ids, limit)
    check_terminal(v, infos)
    await check_unexpected(v, queue, set(ids))
    await check_results_once(v, queue, infos)
    spans = read_ledger(cluster.ledger)
    v.attempts_run = len(spans)
    killed = {w.proc.pid: w.killed_at for w in cluster.workers if w.killed_at}
    check_overlaps(v, list(spans.values()), killed)
    check_fifo(v, list(infos.values()))
    return v


def check_terminal(v: Verdict, infos: dict[str, JobInfo]) -> None:
    """lost = 0: every id a client was given reached a terminal state (and, here, success)."""
    for job_id, info in infos.items():
        if not info.state.terminal:
            v.lost += 1
            v.problems.append(f"{job_id} never ended: {info.state}")
        elif info.state != "succeeded":
            v.not_succeeded += 1
            v.problems.append(f"{job_id} ended {info.state}: {info.detail}")
        if len(info.attempts) > 1:
            v.reclaimed_jobs += 1


async def check_unexpected(v: Verdict, queue: JobQueue, known: set[str]) -> None:
    """unexpected = 0: the pool holds no job that no client was given."""
    for q in await queue.queues():
        members = cast(list[bytes], await queue.redis.zrange(keys.jobs(q), 0, -1))
        for job_id in (m.decode() for m in members):
            if job_id not in known:
                v.unexpected += 1
                v.problems.append(f"{job_id} is in the pool but no client was given it")


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
    """No two attempts of one job ran at the same time. An attempt with no end in the ledger died
    with its SIGKILLed worker (its orphan guard kills them within ms, long before the lease could
    expire); one whose worker was not killed is an unknown end."""
    by_job: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        if span.end is None:
            died = killed.get(_pid_of(span.worker))
            if died is None:
                v.unknown_ends += 1
                v.problems.append(
                    f"{span.job} attempt {span.attempt} on {span.worker}: no end, worker not killed"
                )
                continue
            span.end = died
        by_job[span.job].append(span)
    for job_id, job_spans in by_job.items():
        job_spans.sort(key=lambda s: s.start)
        for a, b in itertools.pairwise(job_spans):
            if a.end is not None and b.start < a.end:
                v.overlaps += 1
                v.problems.append(
                    f"{job_id}: attempt {a.attempt} ({a.start:.3f}-{a.end:.3f}) overlaps attempt {b.attempt}"
                )


def check_fifo(v: Verdict, infos: list[JobInfo]) -> None:
    """Jobs never reclaimed were claimed in enqueue order (claim times are Redis server time)."""
    never = sorted((i for i in infos if len(i.attempts) == 1), key=lambda i: i.seq)
    for a, b in itertools.pairwise(never):
        if a.attempts[0].started_at > b.attempts[0].started_at:
            v.fifo_violations += 1
            v.problems.append(f"{b.id} (seq {b.seq}) started before {a.id} (seq {a.seq})")


def _pid_of(worker_id: str) -> int:
    """Worker ids are HOST-PID-RANDOM; the harness knows its worker processes by pid."""
    parts = worker_id.rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else -1
