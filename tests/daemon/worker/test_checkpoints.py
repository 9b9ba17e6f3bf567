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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from daemon.errors import StaleAttempt
from daemon.job import Attempt, JobState, Lease, Outcome
from daemon.object_store import attempt_segment, checkpoint_prefix
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.worker.checkpoints import Saver, open_beneath, restore
from daemon.worker.runner import JobRun
from daemon.worker.spawn import Spawner
from storage.local import LocalStore
from tests.daemon.worker.test_runner import claimed
from tests.support.faults import aof_copy, roll_back
from tests.support.workers import JOBS_AS_ROOT, fake_gpus, running_worker, sh, wait_state, wait_until

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
    assert b"checkpoint 1 of attempt 1 (" in said


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
        **JOBS_AS_ROOT,
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
    """Markers are `checkpoints/JOB/LEASE.N.done`; a job's own file of that name, or of one with
    other digits than 0-9, lies inside a save and is restored as what it is."""
    source = tmp_path / "ckpt"
    source.mkdir()
    names = ("step", "5.1.done", "w1%2F1.1.1.done", "\u00b9.1.done")
    for name in names:
        (source / name).write_text(name)
    async with LocalStore(tmp_path / "store") as store:
        assert await Saver(store, lease_of(1, "w1/1.1"), source).save() == 4
        dest = tmp_path / "restored"
        dest.mkdir()
        first = attempt_of(1, "w1/1.1")
        assert await restore(store, "default.j", [first], dest) == (first, 1)
    assert sorted(p.name for p in dest.iterdir()) == sorted(names)


def lease_of(attempt: int, lease_id: str) -> Lease:
    return Lease("default.j", attempt, lease_id.partition("/")[0], sh("true"), lease_id)


def attempt_of(attempt: int, lease_id: str) -> Attempt:
    """An entry of the job's history, as the claim writes it."""
    return Attempt(attempt, lease_id.partition("/")[0], 0.0, 1.0, "lost", lease_id)


async def test_a_later_attempt_gets_the_newest_save_of_the_newest_attempt_its_history_knows(
    tmp_path: Path,
) -> None:
    """issue 43 item 7, the rule: saves are named by lease, and the history (oldest first) says
    which count: its newest attempt that has a complete save gives its newest one; a save cut
    short (no marker) is passed over, and one by a lease the history does not hold (an execution
    whose claim Redis forgot) is never taken, however new. Saves named by number (written before
    leases named them) are found for history entries without a lease id."""
    source, dest = tmp_path / "ckpt", tmp_path / "dest"
    source.mkdir()

    async def save(store: LocalStore, lease: Lease, label: str) -> Saver:
        (source / "step").write_text(label)
        saver = Saver(store, lease, source)
        await saver.save()
        return saver

    async def restored(store: LocalStore, *history: Attempt) -> str | None:
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()
        got = await restore(store, "default.j", history, dest)
        return None if got is None else (dest / "step").read_text()

    one, two, forgotten, three = "w1/1.1", "w2/4.1", "w3/1.1", "w4/2.1"
    async with LocalStore(tmp_path / "store") as store:
        first = await save(store, lease_of(1, one), "1a")
        (source / "step").write_text("1b")
        await first.save()
        await save(store, lease_of(2, two), "2a")
        cut_short = f"{checkpoint_prefix('default.j')}{attempt_segment(two)}.2/step"
        await store.put_bytes(cut_short, b"2b, cut short")  # its marker never written
        await save(store, lease_of(2, forgotten), "forgotten")  # the same number as `two`, newer
        await store.put_bytes(f"{checkpoint_prefix('default.j')}1.1/step", b"by number")
        await store.put_bytes(f"{checkpoint_prefix('default.j')}1.1.done", b"")

        assert await restored(store, attempt_of(1, one), attempt_of(2, two)) == "2a"
        assert await restored(store, attempt_of(1, one)) == "1b"
        # an attempt that saved nothing (it died at once) passes over to the one before
        assert await restored(store, attempt_of(1, one), attempt_of(2, two), attempt_of(3, three)) == "2a"
        assert await restored(store) is None
        assert await restored(store, Attempt(1, "w0", 0.0, 1.0, "lost")) == "by number"


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


FAILED = Outcome(JobState.FAILED, exit_code=1)

# Attempt 1 saves which worker ran it (a file of its own, and one named after it) and fails, to be
# retried; a later attempt says what it was given.
WHO_SAVED = (
    'C="$GPUPOOL_CHECKPOINT_DIR"; if [ "$GPUPOOL_ATTEMPT" = 1 ]; then '
    'echo "$GPUPOOL_WORKER" > "$C/who"; touch "$C/by-$GPUPOOL_WORKER"; '
    'echo "$GPUPOOL_WORKER" > "$GPUPOOL_OUTPUT/who"; exit 1; fi; ls "$C"; cat "$C/who"'
)


async def executed(
    queue: JobQueue, store: LocalStore, spawner: Spawner, lease: Lease, data_dir: Path
) -> Mapping[str, Any]:
    """Run `lease`'s attempt to its end, as a worker would (without recording it): its result."""
    run = JobRun(queue, lease, data_dir=data_dir, spawner=spawner, store=store)
    result = await run.run()
    await run.tidy()
    assert result.outcome is not None
    return result.outcome.result


async def test_two_executions_of_one_attempt_number_never_share_a_save_and_the_forgotten_one_is_not_restored(
    redis_server: EmbeddedRedis, redis: Redis, spawner: Spawner, tmp_path: Path
) -> None:
    """issue 43 item 7: Redis restarted from an older AOF forgot worker a's claim, and worker b
    claimed the job again with the same attempt number. Both executions run to their end: each
    saves its checkpoint and uploads its artifacts. They must land apart (keyed by the lease id,
    which never repeats), and the next attempt must resume from b's save, the attempt the job's
    history knows, never from the forgotten a's, even though a wrote last."""
    queue = JobQueue(redis, lease_seconds=30)
    await queue.enqueue(sh(WHO_SAVED, retries=1))
    before = aof_copy(redis_server)
    forgotten = await queue.claim("a", ["default"], 0)
    roll_back(redis_server, before)
    counted = await queue.claim("b", ["default"], 0)
    assert forgotten is not None
    assert counted is not None
    assert forgotten.attempt == counted.attempt == 1

    async with LocalStore(tmp_path / "store") as store:

        async def execute(lease: Lease, slot: str) -> Mapping[str, Any]:
            return await executed(queue, store, spawner, lease, tmp_path / slot)

        counted_result = await execute(counted, "b")
        assert await queue.complete(counted, FAILED) is JobState.QUEUED  # retried
        forgotten_result = await execute(forgotten, "a")  # the zombie ends last
        with pytest.raises(StaleAttempt):
            await queue.complete(forgotten, FAILED)

        saves = [
            o.key for o in await store.list(checkpoint_prefix(counted.job_id)) if o.key.endswith(".done")
        ]
        assert len(saves) == 2, saves  # one each, apart
        ours, theirs = counted_result["artifacts"][0], forgotten_result["artifacts"][0]
        assert ours["key"] != theirs["key"]
        assert await store.get_bytes(ours["key"]) == b"b\n"  # what b's outcome says is there
        assert counted_result["log"]["key"] != forgotten_result["log"]["key"]

        again = await queue.claim("c", ["default"], 0)
        assert again is not None
        assert again.attempt == 2
        # the history names the executions the pool knows: b's, not the forgotten a's
        assert [a.lease for a in (await queue.get(again.job_id)).attempts] == [counted.id, again.id]
        said = (await execute(again, "c"))["tail"]
        assert [line for line in said if not line.startswith("[gpupool]")] == ["by-b", "who", "b"], said


async def test_an_attempt_whose_history_cannot_be_read_waits_for_redis_and_resumes(
    redis_server: EmbeddedRedis, redis: Redis, spawner: Spawner, tmp_path: Path
) -> None:
    """issue 43 item 7: a later attempt reads the job's history (which saves count) before it
    starts. A Redis away at that moment delays the start, as it delays an outcome, and never
    fails the job: it resumes from its save once Redis is back."""
    queue = JobQueue(redis, lease_seconds=30)
    await queue.enqueue(sh(WHO_SAVED, retries=1))
    first = await queue.claim("b", ["default"], 0)
    assert first is not None
    async with LocalStore(tmp_path / "store") as store:
        await executed(queue, store, spawner, first, tmp_path / "b")
        assert await queue.complete(first, FAILED) is JobState.QUEUED
        again = await queue.claim("c", ["default"], 0)
        assert again is not None
        redis_server.kill()
        try:
            task = asyncio.ensure_future(executed(queue, store, spawner, again, tmp_path / "c"))
            await asyncio.sleep(0.5)
            assert not task.done()
        finally:
            redis_server.start()
        said = (await asyncio.wait_for(task, 30))["tail"]
    assert [line for line in said if not line.startswith("[gpupool]")] == ["by-b", "who", "b"], said
