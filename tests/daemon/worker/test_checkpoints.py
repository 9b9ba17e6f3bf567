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
from daemon.queue.claims import Capacity
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.worker.checkpoints import Saver, counted_attempts, open_beneath, restore
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


async def test_a_file_named_like_a_marker_is_restored_as_a_file_not_taken_for_a_save(
    queue: JobQueue, tmp_path: Path
) -> None:
    """Markers are `checkpoints/JOB/LEASE.N.done`; a job's own file of that name, or of one with
    other digits than 0-9, lies inside a save and is restored as what it is."""
    source = tmp_path / "ckpt"
    source.mkdir()
    names = ("step", "5.1.done", "w1%2F1.1.1.done", "\u00b9.1.done")
    for name in names:
        (source / name).write_text(name)
    lease = await claimed(queue, sh("true"))
    async with LocalStore(tmp_path / "store") as store:
        assert await Saver(store, queue, lease, source).save() == 4
        dest = tmp_path / "restored"
        dest.mkdir()
        info = await queue.get(lease.job_id)
        assert info.checkpoint == f"{attempt_segment(lease.id)}.1"
        (first,) = info.attempts
        assert await restore(store, lease.job_id, [first], info.checkpoint, dest) == (first, 1)
    assert sorted(p.name for p in dest.iterdir()) == sorted(names)


def attempt_of(attempt: int, lease_id: str) -> Attempt:
    """An entry of the job's history, as the claim writes it."""
    return Attempt(attempt, lease_id.partition("/")[0], 0.0, 1.0, "lost", lease_id)


async def test_a_later_attempt_gets_the_save_the_job_record_names_if_its_history_knows_the_saver(
    tmp_path: Path,
) -> None:
    """issue 43 item 7 and issue 44 item 9, the rule: saves are named by lease, and the job's
    record names the one to restore (recorded, fenced, by the attempt that held the job); it is
    restored when the history holds the attempt that made it, never when not (an execution whose
    claim Redis forgot), however new; nothing else is restored, not a newer save of an attempt the
    pool took back. With none recorded, saves named by number (written before leases named them)
    are found for history entries without a lease id."""
    dest = tmp_path / "dest"
    prefix = checkpoint_prefix("default.j")

    async def saved(store: LocalStore, name: str, label: str) -> str:
        await store.put_bytes(f"{prefix}{name}/step", label.encode())
        await store.put_bytes(f"{prefix}{name}.done", b"")
        return name

    async def restored(store: LocalStore, recorded: str, *history: Attempt) -> str | None:
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()
        got = await restore(store, "default.j", history, recorded, dest)
        return None if got is None else (dest / "step").read_text()

    one, two, forgotten = "w1/1.1", "w2/4.1", "w3/1.1"
    async with LocalStore(tmp_path / "store") as store:
        first = await saved(store, f"{attempt_segment(one)}.2", "1b")
        await saved(store, f"{attempt_segment(one)}.3", "1c, made after attempt 1 was taken back")
        second = await saved(store, f"{attempt_segment(two)}.1", "2a")
        other = await saved(store, f"{attempt_segment(forgotten)}.1", "forgotten")
        await saved(store, "1.1", "by number")
        known = (attempt_of(1, one), attempt_of(2, two))

        assert await restored(store, second, *known) == "2a"
        assert await restored(store, first, *known) == "1b"  # not 1c, nor 2's: the record says
        assert await restored(store, other, *known) is None  # no attempt the history holds made it
        assert await restored(store, "", *known) is None  # nothing recorded: nothing of theirs
        assert await restored(store, "", Attempt(1, "w0", 0.0, 1.0, "lost"), *known) == "by number"


async def test_a_save_made_after_the_attempt_was_taken_back_is_never_restored(
    redis: Redis, tmp_path: Path
) -> None:
    """issue 44 item 9: a periodic save by an attempt whose lease was taken away (its worker
    stopped past the lease; the job is another attempt's now) could become what a later attempt
    restores. Attempt 1 saves, is taken back; attempt 2 dies before it saves anything; attempt 1
    then saves again, behind the pool's back: the save is refused its record, and attempt 3
    starts from what attempt 1 saved while it held the job (what attempt 2 started from too)."""
    queue = JobQueue(redis, lease_seconds=0.5)
    source, dest = tmp_path / "ckpt", tmp_path / "dest"
    source.mkdir()
    dest.mkdir()

    async def taken_back(worker: str) -> Lease:
        deadline = time.monotonic() + 20
        while not await queue.reclaim():  # as the server's reaper, once the lease has passed
            assert time.monotonic() < deadline, "the lease was never taken back"
            await asyncio.sleep(0.1)
        lease = await queue.claim(worker, ["default"], Capacity(0))
        assert lease is not None
        return lease

    await queue.enqueue(sh("true"))
    first = await queue.claim("a", ["default"], Capacity(0))
    assert first is not None
    async with LocalStore(tmp_path / "store") as store:
        zombie = Saver(store, queue, first, source)
        (source / "step").write_text("held")
        await zombie.save()
        second = await taken_back("b")  # and b dies at once, saving nothing
        (source / "step").write_text("taken back")
        with pytest.raises(StaleAttempt):
            await zombie.save()
        third = await taken_back("c")
        history, recorded = await counted_attempts(queue, third, lambda: False)
        assert [a.lease for a in history] == [first.id, second.id]
        assert await restore(store, third.job_id, history, recorded, dest) == (history[0], 1)
    assert (dest / "step").read_text() == "held"


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
    forgotten = await queue.claim("a", ["default"], Capacity(0))
    roll_back(redis_server, before)
    counted = await queue.claim("b", ["default"], Capacity(0))
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

        again = await queue.claim("c", ["default"], Capacity(0))
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
    first = await queue.claim("b", ["default"], Capacity(0))
    assert first is not None
    async with LocalStore(tmp_path / "store") as store:
        await executed(queue, store, spawner, first, tmp_path / "b")
        assert await queue.complete(first, FAILED) is JobState.QUEUED
        again = await queue.claim("c", ["default"], Capacity(0))
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


async def test_a_cancel_while_the_attempt_is_prepared_stops_the_job_once_it_starts(
    redis_server: EmbeddedRedis, redis: Redis, spawner: Spawner, tmp_path: Path
) -> None:
    """issue 48 (found by the submitit plugin's cancel test, under load): a cancel that comes while
    the attempt is still being prepared (here a later attempt, waiting for Redis to read its
    history before it restores its checkpoint) stops the job with its stop signal as soon as it
    has started. The cancel was noted, and then no signal ever sent: the job ran its whole course,
    whatever else asked it to stop."""
    queue = JobQueue(redis, lease_seconds=30)
    await queue.enqueue(sh("sleep 30", retries=1))
    first = await queue.claim("a", ["default"], Capacity(0))
    assert first is not None
    assert await queue.complete(first, FAILED) is JobState.QUEUED
    again = await queue.claim("b", ["default"], Capacity(0))
    assert again is not None
    async with LocalStore(tmp_path / "store") as store:
        run = JobRun(queue, again, data_dir=tmp_path / "b", spawner=spawner, store=store, kill_grace=1)
        redis_server.kill()
        try:
            task = asyncio.ensure_future(run.run())
            await asyncio.sleep(0.5)
            assert not task.done()  # still reading its history
            run.cancel()
        finally:
            redis_server.start()
        result = await asyncio.wait_for(task, 15)  # the job sleeps 30 s unless stopped
        await run.tidy()
    assert result.outcome is not None
    assert result.outcome.state is JobState.CANCELLED  # by its stop signal, or SIGKILL after its grace
