"""Worker mode (daemon/worker/dispatcher.py) against a real redis-server: order, cancel, drain, SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from redis.asyncio import Redis

from daemon.job import JobState
from daemon.queue import keys
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.queue.registry import list_workers
from tests.support.workers import (
    JOBS_AS_ROOT,
    alive,
    running_worker,
    sh,
    wait_dead,
    wait_file,
    wait_state,
    wait_until,
)


@pytest.mark.both_paths
async def test_fifo_start_order_across_two_workers_with_two_slots(
    redis_server: EmbeddedRedis, queue: JobQueue, tmp_path: Path, fast_path: bool
) -> None:
    order = tmp_path / "order"
    clients = [redis_server.client() for _ in range(2)]  # separate workers, separate connections
    queues = [JobQueue(c, lease_seconds=30, fast_path=fast_path) for c in clients]
    ids = await queue.enqueue_many([sh(f"echo $GPUPOOL_JOB_ID >> {order}") for _ in range(100)])
    async with (
        running_worker(queues[0], tmp_path / "w1", slots=2),
        running_worker(queues[1], tmp_path / "w2", slots=2),
    ):
        infos = [await wait_state(queue, i, JobState.SUCCEEDED) for i in ids]
    for c in clients:
        await c.aclose()

    # Dispatch is strictly FIFO: the claim times (Redis clock) rise in enqueue order, among the
    # jobs claimed once. One kept ahead of a free slot whose slot did not free within the hold
    # (fast_path.py; a loaded machine) is handed back to the front and claimed again, later than
    # jobs behind it that were claimed meanwhile: its claim time is its second (as the chaos
    # checker judges FIFO, on jobs never reclaimed).
    once = [info for info in infos if len(info.attempts) == 1]
    assert len(once) >= 90
    starts = [info.started_at or 0.0 for info in once]
    assert starts == sorted(starts)
    assert len({info.worker for info in infos}) == 2
    # Process start order: four slots start processes concurrently, and no worker waits for an
    # exec, so two jobs claimed back to back may swap, and a job whose exec the scheduler preempts
    # (two cores for two workers, their jobs and Redis) may be overtaken by any job claimed and
    # not yet started: each worker holds up to four (its two slots' and the two it claims ahead,
    # fast_path.py), the other worker's four and its own worker's three others: seven places.
    # The line each job appends is one more step the scheduler may preempt after its start, and a
    # preempted job may be overtaken so twice over. So none is more than 14 places from its enqueue
    # position, while a dispatch out of FIFO order (LIFO, or any order by chance) moves jobs dozens.
    started = order.read_text().split()
    assert sorted(started) == sorted(ids)
    assert all(abs(started.index(job_id) - n) <= 14 for n, job_id in enumerate(ids)), started


@pytest.mark.both_paths
async def test_cancel_through_the_queue_kills_grandchildren(queue: JobQueue, tmp_path: Path) -> None:
    script = 'sleep 300 & echo "$$ $!" > pids.tmp; mv pids.tmp pids; sleep 300'
    job_id, _ = await queue.enqueue(sh(script, cwd=str(tmp_path)))
    async with running_worker(queue, tmp_path / "w"):
        pids = [int(p) for p in (await wait_file(tmp_path / "pids"))[0].split()]
        assert await queue.cancel(job_id) == "cancelling"
        info = await wait_state(queue, job_id, JobState.CANCELLED)
        await wait_dead(pids)
    assert info.detail.startswith("cancelled")
    assert [a.how for a in info.attempts] == ["cancelled"]


@pytest.mark.both_paths
async def test_cancel_reaches_the_worker_without_waiting_for_its_heartbeat(
    queue: JobQueue, tmp_path: Path, fast_path: bool
) -> None:
    # Heartbeats every 10 minutes: only the cancel nudge (pub/sub) can stop the job within the
    # test's bound. The lease is long enough that nothing else intervenes.
    lease_queue = JobQueue(queue.redis, lease_seconds=3600, fast_path=fast_path)
    job_id, _ = await lease_queue.enqueue(sh("echo started > started; sleep 300", cwd=str(tmp_path)))
    async with running_worker(lease_queue, tmp_path / "w", heartbeat_seconds=600):
        await wait_file(tmp_path / "started")
        assert await lease_queue.cancel(job_id) == "cancelling"
        info = await wait_state(lease_queue, job_id, JobState.CANCELLED, timeout=60)
    assert [a.how for a in info.attempts] == ["cancelled"]


@pytest.mark.both_paths
async def test_a_requeued_job_gets_sigterm_and_runs_again_with_the_next_attempt(
    queue: JobQueue, tmp_path: Path, fast_path: bool
) -> None:
    """poolctl requeue's path, with a real worker: the job is told (SIGTERM) and stops, its attempt
    is handed back, and it runs again, at once, as attempt 2, which ends it. Heartbeats 10 minutes
    apart: the requeue reaches the worker by its nudge."""
    lease_queue = JobQueue(queue.redis, lease_seconds=3600, fast_path=fast_path)
    script = (
        'echo "start $GPUPOOL_ATTEMPT" >> log; '
        'if [ "$GPUPOOL_ATTEMPT" = 1 ]; then trap "echo term >> log; exit 0" TERM; sleep 300 & wait; fi; '
        'echo "done $GPUPOOL_ATTEMPT" >> log'
    )
    job_id, _ = await lease_queue.enqueue(sh(script, cwd=str(tmp_path)))
    async with running_worker(lease_queue, tmp_path / "w", heartbeat_seconds=600):
        await wait_until(
            lambda: asyncio.sleep(0, (tmp_path / "log").exists()), what="the first attempt to start"
        )
        assert await lease_queue.requeue(job_id) == "requeueing"
        info = await wait_state(lease_queue, job_id, JobState.SUCCEEDED, timeout=60)
    assert (tmp_path / "log").read_text().split("\n") == ["start 1", "term", "start 2", "done 2", ""]
    assert (info.attempt, [a.how for a in info.attempts]) == (2, ["released", "succeeded"])


async def test_a_job_is_stopped_with_the_signal_and_grace_it_asked_for(
    queue: JobQueue, tmp_path: Path
) -> None:
    """--stop-signal USR1 --stop-grace 30: a cancel sends USR1, and the job's 1 s of saving its
    state is let run (the worker's own grace, 0.2 s here, would have cut it short)."""
    script = (
        "trap 'echo usr1 >> log; sleep 1; echo saved >> log; exit 0' USR1; echo up > log; sleep 300 & wait"
    )
    job_id, _ = await queue.enqueue(sh(script, cwd=str(tmp_path), stop_signal="USR1", stop_grace=30))
    async with running_worker(queue, tmp_path / "w", kill_grace=0.2):
        await wait_file(tmp_path / "log")
        assert await queue.cancel(job_id) == "cancelling"
        await wait_state(queue, job_id, JobState.CANCELLED, timeout=30)
    assert (tmp_path / "log").read_text().split() == ["up", "usr1", "saved"]


@pytest.mark.both_paths
async def test_a_timed_out_job_is_killed_with_its_grandchildren(queue: JobQueue, tmp_path: Path) -> None:
    script = 'sleep 300 & echo "$$ $!" > pids.tmp; mv pids.tmp pids; sleep 300'
    job_id, _ = await queue.enqueue(sh(script, cwd=str(tmp_path), timeout=0.5))
    async with running_worker(queue, tmp_path / "w"):
        info = await wait_state(queue, job_id, JobState.FAILED)
    assert info.detail.startswith("timed out after 0.5 s")
    await wait_dead([int(p) for p in (tmp_path / "pids").read_text().split()])


@pytest.mark.both_paths
async def test_graceful_stop_lets_a_short_job_finish_and_hands_a_long_one_back(
    queue: JobQueue, redis: Redis, tmp_path: Path
) -> None:
    short, _ = await queue.enqueue(sh("sleep 0.5"))
    long, _ = await queue.enqueue(sh("echo $$ > pid; exec sleep 300", cwd=str(tmp_path), max_attempts=2))
    later, _ = await queue.enqueue(sh("true"))
    worker_ctx = running_worker(queue, tmp_path / "w", slots=2, drain_timeout=1.5)
    worker = await worker_ctx.__aenter__()
    pid = int((await wait_file(tmp_path / "pid"))[0])
    assert set(worker.running) == {short, long}
    await worker.stop()  # drain_timeout 1.5 s: `short` ends within it, `long` does not
    await worker_ctx.__aexit__(None, None, None)  # a second stop: harmless

    assert (await queue.get(short)).state is JobState.SUCCEEDED
    info = await queue.get(long)
    assert info.state is JobState.QUEUED
    assert [a.how for a in info.attempts] == ["released"]
    assert not alive(pid)
    assert (await queue.get(later)).state is JobState.QUEUED  # never claimed while draining
    assert await list_workers(redis) == []  # a clean stop unregisters

    # handed back to the front of the queue: claimed next, with attempt 2
    lease = await queue.claim("w2", ["default"])
    assert lease is not None
    assert (lease.job_id, lease.attempt) == (long, 2)
    # and the hand-back is not a lost attempt: losing attempt 2 is the first of max_attempts=2
    await redis.zadd(keys.leases("default"), {long: 0})
    assert await queue.reclaim() == [(long, JobState.QUEUED)]


@pytest.mark.both_paths
async def test_a_second_stop_kills_at_once_and_still_hands_back(queue: JobQueue, tmp_path: Path) -> None:
    job_id, _ = await queue.enqueue(sh("echo $$ > pid; trap '' TERM; sleep 300", cwd=str(tmp_path)))
    worker_ctx = running_worker(queue, tmp_path / "w", kill_grace=300, drain_timeout=300)
    worker = await worker_ctx.__aenter__()
    pid = int((await wait_file(tmp_path / "pid"))[0])
    stopping = asyncio.create_task(worker.stop())
    await asyncio.sleep(0.2)
    assert not stopping.done()  # draining: the job may take up to 300 s
    await worker.stop(drain_timeout=0)  # a second signal: SIGTERM is ignored, so SIGKILL now
    await asyncio.wait_for(stopping, 30)
    await worker_ctx.__aexit__(None, None, None)
    assert not alive(pid)
    assert (await queue.get(job_id)).state is JobState.QUEUED


async def test_a_sigkilled_worker_process_leaves_no_orphans(
    redis_server: EmbeddedRedis, queue: JobQueue, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    # Started as a user starts `poold --worker`: its own process, configured by GPUPOOL_* variables.
    env = {
        **os.environ,
        "GPUPOOL_WORKER_MODE": "multinode",
        "GPUPOOL_REDIS_PORT": str(redis_server.port),
        "GPUPOOL_MAIN_SERVER_REDIS_PASSWORD": redis_server.password,
        "GPUPOOL_DATA_DIR": str(tmp_path / "data"),
        "GPUPOOL_WORKER_HEALTHY_RESPONSE_PERIOD": "5",
        "GPUPOOL_METRICS_LISTEN": "127.0.0.1:0",
        **s3_env,
        **JOBS_AS_ROOT,
    }
    job_id, _ = await queue.enqueue(
        sh('sleep 300 & echo "$$ $!" > pids.tmp; mv pids.tmp pids; exec sleep 300', cwd=str(tmp_path))
    )
    with (
        open(tmp_path / "worker.log", "wb") as log,
        subprocess.Popen([sys.executable, "-m", "daemon.main", "--worker"], env=env, stderr=log) as proc,
    ):
        try:
            pids = [int(p) for p in (await wait_file(tmp_path / "pids"))[0].split()]
            assert (await queue.get(job_id)).state is JobState.RUNNING
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
        proc.wait(10)
    await wait_dead(pids)


async def test_worker_process_drains_on_sigterm(
    redis_server: EmbeddedRedis, queue: JobQueue, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    env = {
        **os.environ,
        "GPUPOOL_WORKER_MODE": "multinode",
        "GPUPOOL_REDIS_PORT": str(redis_server.port),
        "GPUPOOL_MAIN_SERVER_REDIS_PASSWORD": redis_server.password,
        "GPUPOOL_DATA_DIR": str(tmp_path / "data"),
        "GPUPOOL_METRICS_LISTEN": "127.0.0.1:0",
        **s3_env,
        **JOBS_AS_ROOT,
    }
    job_id, _ = await queue.enqueue(sh("echo started > started; sleep 0.5", cwd=str(tmp_path)))
    argv = [sys.executable, "-m", "daemon.main", "--worker"]  # `poold --worker`, as the unit runs it
    with subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL) as proc:
        await wait_file(tmp_path / "started")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    assert (await queue.get(job_id)).state is JobState.SUCCEEDED


async def test_worker_registers_and_lists_itself(queue: JobQueue, redis: Redis, tmp_path: Path) -> None:
    async with running_worker(queue, tmp_path / "w", slots=3, queues=("high", "default")) as worker:
        await wait_until(lambda: _listed(redis), what="the worker to be listed")
        [record] = await list_workers(redis)
        assert record["id"] == worker.id
        assert record["id"].startswith(f"{record['host']}-{os.getpid()}-")  # host-pid-random
        assert (record["slots"], record["queues"], record["health"]) == (3, ["high", "default"], "healthy")
        assert record["gpus"] == []
        assert record["cpus"] >= 1
        assert record["memory"] > 0
        assert 0 <= record["last_heartbeat_age"] < 30


async def _listed(redis: Redis) -> bool:
    return bool(await list_workers(redis))
