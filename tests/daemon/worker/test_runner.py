"""One attempt as processes (daemon/worker/runner.py): environment, live output, stopping, leftovers."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from redis.asyncio import Redis

from daemon.job import JobSpec, JobState, Lease
from daemon.queue import keys
from daemon.queue.claims import Capacity
from daemon.queue.job_queue import JobQueue
from daemon.worker.run_types import Ending, RunResult
from daemon.worker.runner import JobRun
from daemon.worker.spawn import Spawner
from tests.support.workers import alive, fake_gpus, sh, wait_dead, wait_file


async def claimed(queue: JobQueue, spec: JobSpec, worker: str = "w1") -> Lease:
    await queue.enqueue(spec)
    lease = await queue.claim(worker, [spec.queue], Capacity(gpus_free=8))
    assert lease is not None
    return lease


async def test_environment_directory_and_outcome(spawner: Spawner, queue: JobQueue, tmp_path: Path) -> None:
    out = tmp_path / "env.txt"
    lease = await claimed(
        queue,
        sh(
            f'env > {out}; pwd >> {out}; echo "line $$"; mkdir left; touch left/x; exit 3',
            env={"MY_VAR": "mine", "GPUPOOL_JOB_ID": "forged", "CUDA_VISIBLE_DEVICES": "forged"},
        ),
    )
    gpus = fake_gpus(3)[1:]
    base = {"PATH": os.environ["PATH"], "GPUPOOL_MAIN_SERVER_REDIS_PASSWORD": "secret", "KEEP": "1"}
    run = JobRun(queue, lease, spawner=spawner, data_dir=tmp_path / "data", gpus=gpus, env=base)
    result = await run.run()
    await run.tidy()

    env = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    assert env["GPUPOOL_JOB_ID"] == lease.job_id  # the spec cannot forge the pool's variables
    assert env["GPUPOOL_ATTEMPT"] == "1"
    assert env["GPUPOOL_QUEUE"] == "default"
    assert env["GPUPOOL_WORKER"] == "w1"
    assert env["CUDA_VISIBLE_DEVICES"] == f"{gpus[0].uuid},{gpus[1].uuid}"
    assert env["MY_VAR"] == "mine"
    assert "KEEP" not in env  # of the daemon's environment: PATH, HOME, the locale (run_types.PASSED_ENV)
    assert "GPUPOOL_MAIN_SERVER_REDIS_PASSWORD" not in env  # the worker's settings stay its own
    scratch = out.read_text().splitlines()[-1]
    assert scratch == str(tmp_path / "data" / "slot" / "work")  # the slot's scratch directory
    assert not Path(scratch).exists() or not any(Path(scratch).iterdir())  # emptied after the attempt, tidied

    assert result.ending is Ending.EXITED
    assert result.outcome is not None
    outcome = result.outcome
    assert (outcome.state, outcome.exit_code, outcome.detail) == (JobState.FAILED, 3, "exited with status 3")
    assert outcome.result["tail"] == [f"line {run.pid}"]
    assert outcome.result["gpus"] == [g.uuid for g in gpus]
    assert outcome.result["ended_at"] >= outcome.result["started_at"]


async def test_cpu_job_sees_no_gpu_and_runs_in_its_cwd(
    spawner: Spawner, queue: JobQueue, tmp_path: Path
) -> None:
    lease = await claimed(queue, sh('echo "[$CUDA_VISIBLE_DEVICES]" > seen; pwd >> seen', cwd=str(tmp_path)))
    result = await JobRun(queue, lease, spawner=spawner, data_dir=tmp_path / "data").run()
    assert result.outcome is not None
    assert result.outcome.state is JobState.SUCCEEDED
    assert (tmp_path / "seen").read_text().split() == ["[]", str(tmp_path)]


async def test_a_command_that_cannot_start_fails_with_the_reason(
    spawner: Spawner, queue: JobQueue, tmp_path: Path
) -> None:
    lease = await claimed(queue, JobSpec(argv=("no-such-command-gpupool",)))
    result = await JobRun(queue, lease, spawner=spawner, data_dir=tmp_path).run()
    assert result.outcome is not None
    assert result.outcome.state is JobState.FAILED
    assert "no-such-command-gpupool" in result.outcome.detail
    assert b"cannot start" in b"".join(chunk for _, chunk in await queue.read_log(lease.job_id))


async def test_output_reaches_redis_while_the_job_runs(
    spawner: Spawner, queue: JobQueue, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    lease = await claimed(queue, sh(f"echo first; while [ ! -e {go} ]; do sleep 0.02; done; echo second >&2"))
    task = asyncio.create_task(JobRun(queue, lease, spawner=spawner, data_dir=tmp_path).run())
    first = await queue.read_log(lease.job_id, block=20)
    assert [chunk for _, chunk in first] == [b"first\n"]
    assert not task.done()
    go.touch()
    result = await task
    assert result.outcome is not None
    assert result.outcome.state is JobState.SUCCEEDED
    chunks = await queue.read_log(lease.job_id)
    assert b"".join(chunk for _, chunk in chunks) == b"first\nsecond\n"  # stderr merged, in order


async def test_large_output_is_sent_in_chunks_of_at_most_64_kib(
    spawner: Spawner, queue: JobQueue, tmp_path: Path
) -> None:
    lease = await claimed(queue, sh("head -c 300000 /dev/zero | tr '\\0' x"))
    await JobRun(queue, lease, spawner=spawner, data_dir=tmp_path).run()
    chunks = [chunk for _, chunk in await queue.read_log(lease.job_id, count=1000)]
    assert b"".join(chunks) == b"x" * 300000
    assert max(len(c) for c in chunks) <= 64 * 1024


GRANDCHILDREN = 'sleep 300 & echo "$$ $!" > pids.tmp; mv pids.tmp pids; sleep 300'


async def test_cancel_kills_the_job_and_its_grandchildren(
    spawner: Spawner, queue: JobQueue, tmp_path: Path
) -> None:
    lease = await claimed(queue, sh(GRANDCHILDREN, cwd=str(tmp_path)))
    run = JobRun(queue, lease, spawner=spawner, data_dir=tmp_path, kill_grace=5)
    task = asyncio.create_task(run.run())
    pids = [int(p) for p in (await wait_file(tmp_path / "pids"))[0].split()]
    assert all(alive(p) for p in pids)
    run.cancel()
    result = await asyncio.wait_for(task, 30)
    assert result.outcome is not None
    assert result.outcome.state is JobState.CANCELLED
    assert "signal 15" in result.outcome.detail
    await wait_dead(pids)


async def test_timeout_terms_then_kills_the_whole_group(
    spawner: Spawner, queue: JobQueue, tmp_path: Path
) -> None:
    # The shell and its children ignore SIGTERM: only the SIGKILL after the grace ends them.
    lease = await claimed(queue, sh("trap '' TERM; " + GRANDCHILDREN, cwd=str(tmp_path), timeout=0.5))
    run = JobRun(queue, lease, spawner=spawner, data_dir=tmp_path, kill_grace=0.5)
    result = await asyncio.wait_for(run.run(), 30)
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert result.outcome is not None
    assert (result.outcome.state, result.outcome.exit_code) == (JobState.FAILED, 137)
    assert result.outcome.detail == "timed out after 0.5 s; killed by signal 9 (SIGKILL)"
    await wait_dead(pids)
    log = b"".join(chunk for _, chunk in await queue.read_log(lease.job_id))
    assert b"timed out after 0.5 s" in log


async def test_processes_left_behind_are_killed_even_in_another_session(
    spawner: Spawner, queue: JobQueue, tmp_path: Path
) -> None:
    # One leftover stays in the job's session, one escapes to a session of its own (setsid); the
    # job waits long enough for the RSS sampler to see the second as its descendant.
    lease = await claimed(
        queue,
        sh('sleep 300 & a=$!; setsid sleep 300 & echo "$a $!" > pids; sleep 1.2', cwd=str(tmp_path)),
    )
    result = await JobRun(queue, lease, spawner=spawner, data_dir=tmp_path).run()
    assert result.outcome is not None
    assert result.outcome.state is JobState.SUCCEEDED
    assert result.outcome.result["peak_rss"] > 0
    await wait_dead([int(p) for p in (tmp_path / "pids").read_text().split()])


async def test_a_refused_log_write_kills_the_job_and_records_nothing(
    spawner: Spawner, queue: JobQueue, redis: Redis, tmp_path: Path
) -> None:
    lease = await claimed(
        queue, sh("echo $$ > pid; while true; do echo tick; sleep 0.05; done", cwd=str(tmp_path))
    )
    task = asyncio.create_task(JobRun(queue, lease, spawner=spawner, data_dir=tmp_path).run())
    pid = int((await wait_file(tmp_path / "pid"))[0])
    await redis.zadd(keys.leases("default"), {lease.job_id: 0})  # presumed dead: reclaimed
    await queue.reclaim()
    result: RunResult = await asyncio.wait_for(task, 30)
    assert (result.ending, result.outcome) == (Ending.LOST, None)
    await wait_dead([pid])
    assert (await queue.get(lease.job_id)).state is JobState.QUEUED


@pytest.mark.parametrize("now", [False, True])
async def test_hand_back_stops_the_job_and_records_nothing(
    spawner: Spawner, queue: JobQueue, tmp_path: Path, now: bool
) -> None:
    lease = await claimed(queue, sh("echo $$ > pid; trap '' TERM; sleep 300", cwd=str(tmp_path)))
    run = JobRun(queue, lease, spawner=spawner, data_dir=tmp_path, kill_grace=0.2)
    task = asyncio.create_task(run.run())
    pid = int((await wait_file(tmp_path / "pid"))[0])
    run.hand_back(now=now)
    result = await asyncio.wait_for(task, 30)
    assert (result.ending, result.outcome) == (Ending.HANDED_BACK, None)
    await wait_dead([pid])
