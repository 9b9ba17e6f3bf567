"""Liveness with real worker processes (`poold --worker`) and a short lease: a long job with fresh
heartbeats is never reclaimed; a frozen (SIGSTOPped) worker's job is, and the zombie's result is
refused when it wakes; a job that kills its worker every time ends in dead-letter while the pool
goes on serving."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from daemon.job import JobState
from daemon.queue import keys
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.queue.reads import xrange
from tests.support.processes import terminate
from tests.support.workers import JOBS_AS_ROOT, sh, wait_dead, wait_file, wait_state

LEASE = 1.5


@contextmanager
def worker_process(
    redis_server: EmbeddedRedis, data_dir: Path, s3_env: dict[str, str]
) -> Iterator[subprocess.Popen[bytes]]:
    env = dict(os.environ, GPUPOOL_MAIN_SERVER_REDIS_PASSWORD=redis_server.password, **s3_env, **JOBS_AS_ROOT)
    argv = [
        sys.executable,
        "-m",
        "daemon.main",
        "--worker",
        "--worker-mode",
        "multinode",
        "--redis-port",
        str(redis_server.port),
        "--worker-healthy-response-period",
        str(LEASE),
        "--heartbeat-interval",
        str(LEASE / 8),
        "--metrics-listen",
        "127.0.0.1:0",
        "--data-dir",
        str(data_dir),
        "--drain-timeout",
        "0",
        "--log-level",
        "warning",
    ]
    with open(data_dir.with_suffix(".log"), "ab") as log, subprocess.Popen(argv, env=env, stderr=log) as proc:
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a frozen (SIGSTOPped) worker must wake to end
                terminate(proc, 30)


async def reap_until(queue: JobQueue, done: asyncio.Event) -> None:
    """The server's reaper, in the test: reclaim expired leases until `done`."""
    while not done.is_set():
        await queue.reclaim(["default"])
        await asyncio.sleep(0.1)


async def terminal_events(queue: JobQueue, job_id: str) -> int:
    return sum(
        1 for _, f in await xrange(queue.redis, keys.events("default"), "-") if f[b"job"].decode() == job_id
    )


async def test_long_job_with_heartbeats_is_never_reclaimed(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    queue = JobQueue(redis_server.client(), lease_seconds=LEASE)
    job_id, _ = await queue.enqueue(sh(f"sleep {LEASE * 4}"))  # four lease lengths
    done = asyncio.Event()
    reaper = asyncio.create_task(reap_until(queue, done))
    with worker_process(redis_server, tmp_path / "w1", s3_env):
        info = await wait_state(queue, job_id, JobState.SUCCEEDED, timeout=60)
    done.set()
    await reaper
    assert [(a.attempt, a.how) for a in info.attempts] == [(1, "succeeded")]
    await queue.redis.aclose()


async def test_frozen_worker_is_reclaimed_and_its_zombie_result_refused(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    queue = JobQueue(redis_server.client(), lease_seconds=LEASE)
    marker = tmp_path / "attempts"
    job_id, _ = await queue.enqueue(sh(f'echo "$GPUPOOL_ATTEMPT" >> {marker}; sleep 2'))
    done = asyncio.Event()
    reaper = asyncio.create_task(reap_until(queue, done))
    with worker_process(redis_server, tmp_path / "w1", s3_env) as zombie:
        await wait_file(marker)
        zombie.send_signal(signal.SIGSTOP)  # frozen: no heartbeats; its job runs on and ends
        await wait_state(queue, job_id, JobState.QUEUED, timeout=30)  # the lease expired: reclaimed
        with worker_process(redis_server, tmp_path / "w2", s3_env):
            await wait_file(marker, lines=2)
            zombie.send_signal(signal.SIGCONT)  # it wakes and tries to record attempt 1's result
            info = await wait_state(queue, job_id, JobState.SUCCEEDED, timeout=60)
            await asyncio.sleep(LEASE)  # give the zombie time to try its write
    done.set()
    await reaper
    assert [(a.attempt, a.how) for a in info.attempts] == [(1, "lost"), (2, "succeeded")]
    final = await queue.get(job_id)
    assert (final.attempt, final.state) == (2, JobState.SUCCEEDED)  # the zombie changed nothing
    assert await terminal_events(queue, job_id) == 1
    assert "attempt 1" in (tmp_path / "w1.log").read_text()  # it said its write was refused
    await queue.redis.aclose()


async def test_a_job_that_kills_its_worker_ends_in_dead_letter(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    queue = JobQueue(redis_server.client(), lease_seconds=LEASE)
    # Its parent is the worker (daemon/worker/spawn.py).
    poison, _ = await queue.enqueue(sh("kill -9 $PPID; sleep 60", max_attempts=2))
    healthy, _ = await queue.enqueue(sh("echo fine"))
    done = asyncio.Event()
    reaper = asyncio.create_task(reap_until(queue, done))
    restarts = 0
    for _ in range(6):  # a supervisor (systemd's Restart=on-failure) restarting the worker
        with worker_process(redis_server, tmp_path / f"w{restarts}", s3_env) as proc:
            while proc.poll() is None and not (await queue.get(healthy)).state.terminal:
                await asyncio.sleep(0.1)
        restarts += 1
        if (await queue.get(healthy)).state.terminal:
            break
    done.set()
    await reaper
    info = await queue.get(poison)
    assert info.state is JobState.DEAD
    assert [a.how for a in info.attempts] == ["lost", "lost"]
    assert (await queue.get(healthy)).state is JobState.SUCCEEDED  # and the pool went on
    assert restarts >= 2
    await queue.redis.aclose()


async def test_a_frozen_workers_job_dies_at_its_lease_deadline_and_is_not_recorded(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    """Issue 12 item 10: a SIGSTOPped worker's job ran on beside its next attempt elsewhere. Its
    orphan guard, not frozen with it, holds each lease's deadline and kills the job when it
    passes; the worker, woken, does not take that kill for the job's outcome."""
    queue = JobQueue(redis_server.client(), lease_seconds=LEASE)
    try:
        job_id, _ = await queue.enqueue(sh(f"echo $$ > {tmp_path / 'pid'}; exec sleep 60"))
        with worker_process(redis_server, tmp_path / "w1", s3_env) as frozen:
            pid = int((await wait_file(tmp_path / "pid"))[0])
            frozen.send_signal(signal.SIGSTOP)
            try:
                # Dead while the worker is still frozen (the job sleeps 60 s: only the guard ends
                # it); a bound for a loaded machine, not a speed: the deadline is one lease away.
                await wait_dead([pid], timeout=LEASE * 8)
                assert frozen.poll() is None
            finally:
                frozen.send_signal(signal.SIGCONT)
            await asyncio.sleep(LEASE)  # awake: it would record a "killed by signal 9" now, were it to
            info = await queue.get(job_id)
            assert info.state is JobState.RUNNING, info.detail  # nothing recorded: the lease decides
            await queue.redis.zadd(keys.leases("default"), {job_id: 0})
            assert await queue.reclaim(["default"]) == [(job_id, JobState.QUEUED)]
    finally:  # closed even when an assertion fails: its connections would fail the next tests
        await queue.redis.aclose()
