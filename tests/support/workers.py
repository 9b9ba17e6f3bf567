"""Helpers for the worker tests: start workers on the test's Redis, wait for states, check pids."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psutil

from daemon.job import JobInfo, JobSpec, JobState, Lease, Outcome
from daemon.queue.job_queue import JobQueue
from daemon.worker.dispatcher import Worker
from daemon.worker.gpus import GpuInfo


def sh(script: str, **kw: object) -> JobSpec:
    """A job that runs `script` with sh."""
    return JobSpec(argv=("sh", "-c", script), **kw)  # type: ignore[arg-type]


def note_lingers(queue: JobQueue) -> dict[str, float]:
    """How long each outcome recorded through `queue` from now on may wait for company (its
    `linger`), by job id: the fast path's lingering outcomes, seen from outside."""
    lingers: dict[str, float] = {}
    complete = queue.complete

    async def noted(lease: Lease, outcome: Outcome, *, linger: float = 0.0) -> JobState:
        lingers[lease.job_id] = linger
        return await complete(lease, outcome, linger=linger)

    queue.complete = noted  # type: ignore[method-assign]
    return lingers


def fake_gpus(n: int) -> list[GpuInfo]:
    """The seam: a made-up GPU list standing in for NVML's."""
    return [GpuInfo(i, f"GPU-{i:08d}-fake", "Fake GPU", 16 * 2**30) for i in range(n)]


@asynccontextmanager
async def running_worker(queue: JobQueue, data_dir: Path, **kw: Any) -> AsyncIterator[Worker]:
    """A started Worker (CPU-only and quick to stop unless told otherwise), stopped at the end."""
    kw.setdefault("gpus", [])
    kw.setdefault("heartbeat_seconds", 0.2)
    kw.setdefault("kill_grace", 2.0)
    kw.setdefault("drain_timeout", 0.0)
    worker = Worker(queue, data_dir=data_dir, **kw)
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


async def wait_until(check: Callable[[], Awaitable[bool]], timeout: float = 30.0, what: str = "") -> None:
    """Poll `check` until it is true; fail after `timeout` (a bound, not a speed assertion)."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        await asyncio.sleep(0.02)


async def wait_state(queue: JobQueue, job_id: str, *states: JobState, timeout: float = 30.0) -> JobInfo:
    info: JobInfo | None = None

    async def reached() -> bool:
        nonlocal info
        info = await queue.get(job_id)
        return info.state in states

    await wait_until(reached, timeout, f"job {job_id} to be {'/'.join(states)}")
    assert info is not None
    return info


async def wait_file(path: Path, lines: int = 1, timeout: float = 30.0) -> list[str]:
    """The lines of `path` once it has at least `lines` complete lines."""

    async def ready() -> bool:
        return path.exists() and path.read_text().count("\n") >= lines

    await wait_until(ready, timeout, f"{lines} lines in {path}")
    return path.read_text().splitlines()


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting to be reaped is dead)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def wait_dead(pids: list[int], timeout: float = 15.0) -> None:
    async def gone() -> bool:
        return not any(alive(p) for p in pids)

    await wait_until(gone, timeout, f"processes {pids} to be gone")


def logs_its_span(log: Path, seconds: float = 0.05) -> str:
    """A job's script that appends `start NS` to `log`, runs `seconds`, then appends `end NS`."""
    return f"echo start $(date +%s%N) >> {log}; sleep {seconds}; echo end $(date +%s%N) >> {log}"


def most_at_once(lines: list[str]) -> int:
    """The most jobs running at once in a log of `logs_its_span` lines."""
    events = sorted((int(t), 1 if what == "start" else -1) for what, t in (line.split() for line in lines))
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


# For a `poold` process whose jobs write where only root may (pytest's directories are root's,
# 0700): jobs as root by the explicit choice a root poold now needs (`job_uid_range = "root"`);
# a poold that is not root runs jobs as itself anyway.
JOBS_AS_ROOT: dict[str, str] = {"GPUPOOL_JOB_UID_RANGE": "root"} if os.geteuid() == 0 else {}
