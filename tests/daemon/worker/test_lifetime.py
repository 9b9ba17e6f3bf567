"""A worker that leaves by itself (daemon/worker/lifetime.py): a real `poold --worker --idle-exit`
process leaves, exit 0, unregistered, once it has had no job for that long (the clock restarting
with each job); a worker with a max lifetime takes only jobs whose time limit ends before it must
leave (never one without), stops each job in time for its own stop grace, and says when to begin
its drain so that the drain and the hand-back fit before its end.
The whole of a pilot's life on a real Slurm cluster is tests/daemon/ctl/test_pilot.py."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon import config
from daemon.errors import GpupoolError
from daemon.job import JobState
from daemon.queue import registry
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.worker.lifetime import Lifetime
from tests.support.git_repo import git_daemon, make_repo
from tests.support.workers import JOBS_AS_ROOT, running_worker, sh, wait_file, wait_state, wait_until

IDLE_EXIT = 3.0


def worker_argv(redis_server: EmbeddedRedis, data_dir: Path, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "daemon.main", "--worker", "--worker-mode", "multinode",
        "--redis-port", str(redis_server.port), "--metrics-listen", "127.0.0.1:0",
        "--data-dir", str(data_dir), "--heartbeat-interval", "0.5", *flags,
    ]  # fmt: skip


async def test_an_idle_worker_leaves_exit_0_unregistered_its_clock_restarted_by_each_job(
    tmp_path: Path, redis_server: EmbeddedRedis, queue: JobQueue, s3_env: dict[str, str]
) -> None:
    env = dict(os.environ, GPUPOOL_MAIN_SERVER_REDIS_PASSWORD=redis_server.password, **s3_env, **JOBS_AS_ROOT)
    argv = worker_argv(redis_server, tmp_path / "w", "--idle-exit", f"{IDLE_EXIT:g}")
    with (
        open(tmp_path / "worker.log", "wb") as log,
        subprocess.Popen(argv, env=env, stderr=log) as proc,
    ):
        try:

            async def registered() -> bool:
                return len(await registry.list_workers(queue.redis)) == 1

            await wait_until(registered, 30, "the worker to register")
            job_id, _ = await queue.enqueue(sh("sleep 2"))  # within its first idle seconds
            info = await wait_state(queue, job_id, JobState.SUCCEEDED, JobState.FAILED)
            assert info.state is JobState.SUCCEEDED, info.detail
            assert info.ended_at is not None
            code = await asyncio.to_thread(proc.wait, 30)
            left = time.time()
        finally:
            proc.kill()
    assert code == 0
    # idle for IDLE_EXIT after the job, not after its own start (ended_at is Redis's clock: loopback)
    assert left - info.ended_at >= IDLE_EXIT - 0.5
    text = (tmp_path / "worker.log").read_text()
    assert "leaving: no job for " in text, text
    assert f" s (worker_idle_exit {IDLE_EXIT:g} s)" in text, text
    assert await registry.list_workers(queue.redis) == []  # unregistered, not left to die


def test_a_lifetime_the_drain_cannot_fit_into_stops_poold_in_a_sentence(tmp_path: Path) -> None:
    argv = [
        sys.executable, "-m", "daemon.main", "--worker", "--worker-mode", "multinode",
        "--max-lifetime", "50", "--data-dir", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1
    assert "worker_max_lifetime 50 s leaves no time to work: it must exceed drain_timeout + " in done.stderr
    assert "kill_grace + 1 s to hand back (71 s)" in done.stderr


def lifetime_config(**values: float) -> config.Config:
    return dataclasses.replace(config.load(None, env={}, config_file=None), **values)  # type: ignore[arg-type]


def test_the_drain_begins_early_enough_for_the_drain_the_kill_grace_and_the_hand_back() -> None:
    assert Lifetime.of(lifetime_config()) is None  # neither option: no lifetime at all
    now = time.time()
    c = lifetime_config(worker_max_lifetime=100.0, drain_timeout=20.0, kill_grace=5.0)
    life = Lifetime.of(c, started=now - 10)
    assert life is not None
    assert life.leave_by == pytest.approx(now + 90)
    assert life.drain_in() == pytest.approx(100 - 10 - 20 - 5 - config.HAND_BACK_SECONDS, abs=0.5)
    # a claim may take what ends before the drain stops what still runs: the end less the kill grace
    # and the hand-back
    assert life.claim_lifetime() == pytest.approx(100 - 10 - 5 - config.HAND_BACK_SECONDS, abs=0.5)
    # a job is stopped its own stop grace and the hand-back before the end
    assert life.stop_in(30.0) == pytest.approx(100 - 10 - 30 - config.HAND_BACK_SECONDS, abs=0.5)
    idle_only = Lifetime.of(lifetime_config(worker_idle_exit=60.0))
    assert idle_only is not None
    assert (idle_only.leave_by, idle_only.drain_in(), idle_only.claim_lifetime()) == (0.0, None, None)
    assert idle_only.stop_in(30.0) is None
    with pytest.raises(GpupoolError, match="must exceed drain_timeout"):
        Lifetime.of(lifetime_config(worker_max_lifetime=25.0, drain_timeout=20.0, kill_grace=5.0))


async def test_a_worker_with_an_end_passes_over_jobs_that_would_outlive_it_and_leaves_in_time(
    tmp_path: Path, queue: JobQueue
) -> None:
    c = lifetime_config(worker_max_lifetime=6.0, drain_timeout=1.0, kill_grace=1.0)
    life = Lifetime.of(c, started=time.time())
    assert life is not None
    outlives, _ = await queue.enqueue(sh("true", timeout=600.0))
    fits, _ = await queue.enqueue(sh("true", timeout=2.0))
    async with running_worker(queue, tmp_path, lifetime=life, kill_grace=1.0, drain_timeout=1.0) as worker:
        info = await wait_state(queue, fits, JobState.SUCCEEDED, JobState.FAILED)
        assert info.state is JobState.SUCCEEDED, info.detail
        [record] = await registry.list_workers(queue.redis)
        assert record["leave_by"] == pytest.approx(life.leave_by)
        began = time.monotonic()
        why = await asyncio.wait_for(life.due(worker.idle_for), 10)
        # at 6 - 1 - 1 - 1 = 3 s from its start, less the time the job above took
        assert time.monotonic() - began < 3.5
        assert time.time() == pytest.approx(life.leave_by - 1 - 1 - config.HAND_BACK_SECONDS, abs=0.5)
        assert why.startswith("its lifetime ends at ")
    assert (await queue.get(outlives)).state is JobState.QUEUED


async def test_a_pilot_never_claims_a_job_without_a_time_limit_a_worker_without_an_end_runs_it(
    tmp_path: Path, queue: JobQueue
) -> None:
    """issue 43 item 5: a pilot claimed jobs without --timeout, which could only run into its end,
    where the batch system's kill lost them. Neither its claim nor the one it leaves standing while
    idle takes such a job now: it stays queued, and a worker without an end runs it."""
    c = lifetime_config(worker_max_lifetime=60.0, drain_timeout=1.0, kill_grace=1.0)
    life = Lifetime.of(c, started=time.time())
    assert life is not None
    queued_before, _ = await queue.enqueue(sh("true"))
    async with running_worker(queue, tmp_path / "pilot", lifetime=life, kill_grace=1.0):
        fits, _ = await queue.enqueue(sh("true", timeout=5.0))
        info = await wait_state(queue, fits, JobState.SUCCEEDED, JobState.FAILED)
        assert info.state is JobState.SUCCEEDED, info.detail
        await asyncio.sleep(0.5)  # idle: its claim stands, and the next enqueue here sends it
        queued_while_idle, _ = await queue.enqueue(sh("true"))
        after, _ = await queue.enqueue(sh("true", timeout=5.0))
        info = await wait_state(queue, after, JobState.SUCCEEDED, JobState.FAILED)
        assert info.state is JobState.SUCCEEDED, info.detail
        for job_id in (queued_before, queued_while_idle):
            info = await queue.get(job_id)
            assert (info.state, info.attempt) == (JobState.QUEUED, 0), info
    async with running_worker(queue, tmp_path / "plain"):
        for job_id in (queued_before, queued_while_idle):
            info = await wait_state(queue, job_id, JobState.SUCCEEDED, JobState.FAILED)
            assert info.state is JobState.SUCCEEDED, info.detail


async def test_a_pilot_hands_back_a_job_whose_stop_grace_exceeds_kill_grace_before_its_end(
    tmp_path: Path, queue: JobQueue
) -> None:
    """issue 43 item 5: a job's --stop-grace longer than the pilot's kill_grace ran past the pilot's
    end, where the batch system's kill made it a loss. Here its code comes from a slow git server,
    so it starts 2 s after its claim and is still within its --timeout when the pilot must stop it
    in time for its own stop grace: it ignores SIGTERM, is killed after its grace, and is handed
    back (queued again, not lost) before the pilot's lifetime ends; then the pilot has left."""
    (tmp_path / "git").mkdir()
    commit, _ = make_repo(tmp_path / "git" / "repo")
    c = lifetime_config(worker_max_lifetime=7.0, drain_timeout=0.5, kill_grace=0.5)
    life = Lifetime.of(c, started=time.time())
    assert life is not None
    started = tmp_path / "started"
    with git_daemon(tmp_path / "git", delay=2.0) as url:
        # 3.5 s + 1.5 s of grace fit in what the pilot has left at its claim; from its late
        # start, its --timeout would end after the pilot must have stopped it
        job_id, _ = await queue.enqueue(
            sh(
                f"trap '' TERM; echo $$ > {started}; sleep 30",
                timeout=3.5,
                stop_grace=1.5,
                git={"repo": url + "repo", "commit": commit},
            )
        )
        async with running_worker(
            queue, tmp_path / "w", lifetime=life, kill_grace=0.5, drain_timeout=0.5
        ) as worker:
            await wait_file(started, timeout=10)
            await asyncio.wait_for(life.due(worker.idle_for), 10)
            await worker.stop()  # as poold does once its lifetime is due
            left = time.time()
    assert left < life.leave_by, f"left {left - life.leave_by:.1f} s after its end"
    info = await queue.get(job_id)
    assert (info.state, info.attempt) == (JobState.QUEUED, 1), info  # handed back, not lost
