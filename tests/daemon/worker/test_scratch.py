"""scratch.py: a slot's directories are empty and real for every job, and never shared."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.job import JobState
from daemon.queue.job_queue import JobQueue
from daemon.worker.dir_watch import DirWatch
from daemon.worker.runner import JobRun
from daemon.worker.scratch import SlotDirs, SlotScratch
from daemon.worker.spawn import Spawner
from tests.daemon.worker.test_runner import claimed
from tests.support.workers import sh


@pytest.fixture(params=["watched", "unwatched"])
def watch(request: pytest.FixtureRequest) -> Iterator[DirWatch | None]:
    """A worker's slots are watched (dir_watch.py); without inotify each directory is looked at."""
    if request.param == "unwatched":
        yield None
        return
    w = DirWatch()
    yield w
    w.close()


async def test_a_slot_is_reset_whatever_the_last_job_left(
    spawner: Spawner, queue: JobQueue, tmp_path: Path, watch: DirWatch | None
) -> None:
    slot = tmp_path / "slot"
    scratch = SlotScratch(slot, None, watch)
    outside = tmp_path / "outside"
    (outside / "secret").mkdir(parents=True)
    # a read-only tree in the cwd, and `out` swapped for a symlink to someone else's files
    messy = "mkdir -p ro/d; touch ro/d/f; chmod -R a-w ro; "
    messy += f'rm -rf "$GPUPOOL_OUTPUT"; ln -s {outside} "$GPUPOOL_OUTPUT"; '
    messy += 'chmod 777 "$GPUPOOL_CHECKPOINT_DIR"'
    job = JobRun(queue, await claimed(queue, sh(messy)), data_dir=tmp_path, slot=scratch, spawner=spawner)
    first = await job.run()
    await job.tidy()
    assert first.outcome is not None
    assert first.outcome.state is JobState.SUCCEEDED
    seen = tmp_path / "seen"
    look = f'ls -A . "$GPUPOOL_OUTPUT" > {seen}; test -d "$GPUPOOL_OUTPUT" && ! test -L "$GPUPOOL_OUTPUT"'
    look += f'; stat -c %a "$GPUPOOL_CHECKPOINT_DIR" >> {seen}'
    second = await JobRun(
        queue, await claimed(queue, sh(look)), data_dir=tmp_path, slot=scratch, spawner=spawner
    ).run()
    assert second.outcome is not None
    assert second.outcome.state is JobState.SUCCEEDED, second.outcome.result["tail"]
    assert seen.read_text().split() == [".:", f"{slot / 'out'}:", "700"]  # both empty, ckpt its own again
    assert (outside / "secret").is_dir()  # the link was removed, not followed
    assert sorted(p.name for p in slot.rglob("*")) == ["ckpt", "out", "work"]  # all there, all empty


async def test_a_job_that_left_its_slot_as_it_found_it_hands_it_over_at_once(
    spawner: Spawner, queue: JobQueue, tmp_path: Path
) -> None:
    """Once its processes are gone, a job that changed none of its slot's directories frees the
    slot for the next job before its own end is recorded (runner.JobRun._hand_over); one that
    changed any keeps it until they are reset, and its artifacts are its own."""
    watch = DirWatch()
    scratch = SlotScratch(tmp_path / "slot", None, watch)
    freed: list[str] = []

    async def run(script: str) -> JobRun:
        lease = await claimed(queue, sh(script))
        job = JobRun(
            queue, lease, data_dir=tmp_path, slot=scratch, spawner=spawner,
            on_slot_free=lambda: freed.append(lease.job_id),
        )  # fmt: skip
        result = await job.run()
        assert result.outcome is not None
        assert result.outcome.state is JobState.SUCCEEDED, result.outcome.result["tail"]
        return job

    try:
        quiet = await run("echo only to its log")
        assert freed == [quiet.lease.job_id]
        await asyncio.wait_for(scratch.prepare([scratch.work]), 1)  # the next job need not wait
        scratch._release()
        await quiet.tidy()  # nothing left to do: the directories are the next job's

        busy = await run('echo result > "$GPUPOOL_OUTPUT/r.txt"')
        assert freed == [quiet.lease.job_id]  # not handed over: its output is there to take
        assert (scratch.out / "r.txt").read_text() == "result\n"
        await busy.tidy()
        assert not any(scratch.out.iterdir())
        assert freed == [quiet.lease.job_id]
        await run("true")  # the reset directories are as new again
        assert len(freed) == 2
    finally:
        watch.close()


async def test_a_job_with_nothing_to_come_first_starts_in_its_callers_turn(
    spawner: Spawner, queue: JobQueue, tmp_path: Path
) -> None:
    """`JobRun.start` spawns a job that fetches nothing, on a slot free and as new, in the turn
    that calls it (the worker's: the one that freed the slot), with no turn of the loop between
    one job's end and the next one's start. Any other job starts in `run`, once what comes first
    is done: a new slot's directories, the last job's tidying, its data."""
    scratch = SlotScratch(tmp_path / "slot", None)

    async def job(script: str, **spec: object) -> JobRun:
        lease = await claimed(queue, sh(script, **spec))
        return JobRun(queue, lease, data_dir=tmp_path, slot=scratch, spawner=spawner)

    first = await job('echo first > "$GPUPOOL_OUTPUT/f"')
    first.start()
    assert first.pid is None  # a new slot: its directories are made first, in `run`
    result = await first.run()
    assert result.outcome is not None
    assert result.outcome.state is JobState.SUCCEEDED

    second = await job("true")
    second.start()
    assert second.pid is None  # the slot is still the first job's, until its tidying
    running = asyncio.create_task(second.run())
    await asyncio.sleep(0.05)
    assert second.pid is None
    assert not running.done()
    await first.tidy()
    result = await asyncio.wait_for(running, 10)
    assert result.outcome is not None
    assert result.outcome.state is JobState.SUCCEEDED
    await second.tidy()

    data = [{"sha256": "0" * 64, "dest": "d.bin", "kind": "file"}]
    with_data = await job("true", inputs=data)
    with_data.start()
    assert with_data.pid is None  # its data first: in `run`

    third = await job("sleep 30")
    third.start()
    assert third.pid is not None  # spawned in this turn
    third.cancel()  # before its `run`: stopped as any running job is
    result = await asyncio.wait_for(third.run(), 15)
    assert result.outcome is not None
    assert result.outcome.state is JobState.CANCELLED, result.outcome
    await third.tidy()


def hold_lock(root: Path, worker_id: str) -> subprocess.Popen[str]:
    """Another worker process holding its slot directories until its stdin closes."""
    code = (
        "import sys; from pathlib import Path; from daemon.worker.scratch import SlotDirs;"
        f"d = SlotDirs(Path({str(root)!r}), {worker_id!r}); d.open(); d.slot(0).mkdir(parents=True);"
        "print('ok', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ok"
    return proc


def test_workers_sharing_a_data_dir_keep_their_own_slots_and_clear_dead_ones(tmp_path: Path) -> None:
    root = tmp_path / "slots"
    live = hold_lock(root, "host-1-live")
    dead = hold_lock(root, "host-2-dead")
    dead.kill()  # its lock goes with it; its directories stay behind
    dead.communicate()
    (root / "old-layout-0").mkdir()
    try:
        mine = SlotDirs(root, "host-3-mine")
        mine.open()
        assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
            "host-1-live",
            "host-1-live.lock",
            "host-3-mine.lock",
        ]
        assert (root / "host-1-live" / "0").is_dir()
        assert mine.slot(0) != root / "host-1-live" / "0"
        mine.close()
        assert not os.path.lexists(root / "host-3-mine.lock")
    finally:
        live.communicate()
