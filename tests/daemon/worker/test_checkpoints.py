"""$GPUPOOL_CHECKPOINT_DIR carried from one attempt to the next (worker/checkpoints.py): saved at an
attempt's end and every --checkpoint-every seconds, restored into the next attempt. With a real
worker: a requeued job resumes from what it saved on SIGTERM; and a job whose worker process is
SIGKILLed resumes, on another worker, from its last periodic save in a real S3 endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis.asyncio import Redis

from daemon.job import JobState
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.worker.checkpoints import Saver, open_beneath, restore
from daemon.worker.runner import JobRun
from daemon.worker.spawn import Spawner
from storage.local import LocalStore
from tests.daemon.worker.test_runner import claimed
from tests.support.workers import fake_gpus, running_worker, sh, wait_state, wait_until

# Reads the step its last save reached, says so, and (attempt 1) waits, saving its step on SIGTERM
# or (with `step`) at once, for a periodic save to carry.
RESUMING = (
    'n=$(cat "$GPUPOOL_CHECKPOINT_DIR/step" 2>/dev/null || echo 0); '
    'echo "attempt $GPUPOOL_ATTEMPT from $n" >> {log}; '
    'if [ "$GPUPOOL_ATTEMPT" = 1 ]; then '
    'trap \'echo 7 > "$GPUPOOL_CHECKPOINT_DIR/step.tmp"; mv "$GPUPOOL_CHECKPOINT_DIR/step.tmp" '
    '"$GPUPOOL_CHECKPOINT_DIR/step"; exit 0\' TERM; {step}sleep 300 & wait; fi'
)


async def logged(path: Path, line: str) -> bool:
    return path.exists() and line in path.read_text().splitlines()


async def test_a_requeued_job_starts_again_from_what_it_saved_on_sigterm(
    queue: JobQueue, tmp_path: Path
) -> None:
    log = tmp_path / "log"
    job_id, _ = await queue.enqueue(sh(RESUMING.format(log=log, step="")))
    async with (
        LocalStore(tmp_path / "store") as store,
        running_worker(queue, tmp_path / "w", store=store),
    ):
        await wait_until(lambda: logged(log, "attempt 1 from 0"), what="the first attempt")
        assert await queue.requeue(job_id) == "requeueing"
        info = await wait_state(queue, job_id, JobState.SUCCEEDED, timeout=60)
    assert log.read_text().splitlines() == ["attempt 1 from 0", "attempt 2 from 7"]
    assert info.attempt == 2
    said = b"".join(data for _, data in await queue.read_log(job_id))
    assert b"checkpoint 1.1 restored" in said


async def test_a_job_whose_worker_was_sigkilled_resumes_from_its_last_periodic_save(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    log = tmp_path / "log"
    queue = JobQueue(redis_server.client(), lease_seconds=2)
    script = RESUMING.format(log=log, step='echo 5 > "$GPUPOOL_CHECKPOINT_DIR/step"; ')
    job_id, _ = await queue.enqueue(sh(script, checkpoint_every=0.2))
    env = {
        **os.environ,
        **s3_env,
        "GPUPOOL_WORKER_MODE": "multinode",
        "GPUPOOL_REDIS_PORT": str(redis_server.port),
        "GPUPOOL_MAIN_SERVER_REDIS_PASSWORD": redis_server.password,
        "GPUPOOL_WORKER_HEALTHY_RESPONSE_PERIOD": "2",
        "GPUPOOL_METRICS_LISTEN": "127.0.0.1:0",
    }
    argv = [sys.executable, "-m", "daemon.main", "--worker"]
    first = subprocess.Popen(
        argv, env={**env, "GPUPOOL_DATA_DIR": str(tmp_path / "w1")}, stderr=subprocess.DEVNULL
    )
    try:
        await wait_until(lambda: logged(log, "attempt 1 from 0"), what="the first attempt")
        await asyncio.sleep(1.0)  # several periodic saves (every 0.2 s) of its step
    finally:
        first.send_signal(signal.SIGKILL)  # the machine's death: no last save, no hand-back
        first.wait(10)
    deadline = time.monotonic() + 30
    while not await queue.reclaim():  # as the server's reaper, once the lease has passed
        assert time.monotonic() < deadline, "the dead worker's lease was never taken back"
        await asyncio.sleep(0.2)
    second = subprocess.Popen(
        argv, env={**env, "GPUPOOL_DATA_DIR": str(tmp_path / "w2")}, stderr=subprocess.DEVNULL
    )
    try:
        info = await wait_state(queue, job_id, JobState.SUCCEEDED, timeout=60)
    finally:
        second.terminate()
        second.wait(30)
        await queue.redis.aclose()
    assert log.read_text().splitlines() == ["attempt 1 from 0", "attempt 2 from 5"]
    assert info.attempt == 2


def test_a_save_reads_only_plain_files_reached_without_a_link(tmp_path: Path) -> None:
    """A periodic save runs while the job does, maybe as another uid: a file, or a directory on
    its path, swapped for a symlink after the walk is not followed to what the worker may read."""
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "state").write_text("mine")
    secret = tmp_path / "secret"
    (secret / "sub").mkdir(parents=True)
    (secret / "sub" / "state").write_text("the worker's")
    fd = open_beneath(root, "sub/state")
    os.close(fd)
    (root / "sub" / "state").unlink()
    (root / "sub" / "state").symlink_to(secret / "sub" / "state")
    with pytest.raises(OSError, match=r"symbolic links|Not a directory"):
        open_beneath(root, "sub/state")
    shutil.rmtree(root / "sub")
    (root / "sub").symlink_to(secret / "sub")
    with pytest.raises(OSError, match=r"symbolic links|Not a directory"):
        open_beneath(root, "sub/state")
    os.mkfifo(root / "fifo")
    with pytest.raises(OSError, match="not a regular file"):
        open_beneath(root, "fifo")


async def test_an_attempt_cancelled_midway_leaves_no_periodic_save_running(
    queue: JobQueue, spawner: Spawner, tmp_path: Path
) -> None:
    """A worker shutting down cancels its attempts' runs: the periodic saves end with them, rather
    than go on uploading a slot's directory that its next job is given."""
    script = 'echo x > "$GPUPOOL_CHECKPOINT_DIR/step"; echo up > up; sleep 300'
    lease = await claimed(queue, sh(script, cwd=str(tmp_path), checkpoint_every=0.05))
    async with LocalStore(tmp_path / "store") as store:
        run = JobRun(queue, lease, data_dir=tmp_path, spawner=spawner, store=store)
        task = asyncio.ensure_future(run.run())
        await wait_until(lambda: asyncio.sleep(0, (tmp_path / "up").exists()), what="the job to start")
        await asyncio.sleep(0.2)  # saves made
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        saving = run._saving
        assert saving is not None
        assert saving.done()


async def test_a_file_named_like_a_marker_is_restored_as_a_file_not_taken_for_a_save(tmp_path: Path) -> None:
    """Markers are `checkpoints/JOB/ATTEMPT.N.done`; a job's own file of that name, or of one with
    other digits than 0-9, lies inside a save and is restored as what it is."""
    source = tmp_path / "ckpt"
    source.mkdir()
    for name in ("step", "5.1.done", "\u00b9.1.done"):
        (source / name).write_text(name)
    async with LocalStore(tmp_path / "store") as store:
        assert await Saver(store, "default.j", 1, source).save() == 3
        dest = tmp_path / "restored"
        dest.mkdir()
        assert await restore(store, "default.j", 2, dest) == "1.1"
    assert sorted(p.name for p in dest.iterdir()) == sorted(["step", "5.1.done", "\u00b9.1.done"])


async def test_a_job_preempted_by_a_higher_priority_one_resumes_from_its_checkpoint_after_it(
    redis: Redis, tmp_path: Path
) -> None:
    queue = JobQueue(redis, lease_seconds=30, preempt=["default"])
    log = tmp_path / "log"
    low, _ = await queue.enqueue(sh(RESUMING.format(log=log, step=""), gpus=2))
    async with (
        LocalStore(tmp_path / "store") as store,
        running_worker(queue, tmp_path / "w", store=store, gpus=fake_gpus(2), slots=2),
    ):
        await wait_until(lambda: logged(log, "attempt 1 from 0"), what="the first attempt")
        urgent, _ = await queue.enqueue(sh(f"echo urgent >> {log}", gpus=2, priority=5))
        await wait_state(queue, urgent, JobState.SUCCEEDED, timeout=60)
        info = await wait_state(queue, low, JobState.SUCCEEDED, timeout=60)
    assert log.read_text().splitlines() == ["attempt 1 from 0", "urgent", "attempt 2 from 7"]
    assert [a.how for a in info.attempts] == ["released", "succeeded"]
