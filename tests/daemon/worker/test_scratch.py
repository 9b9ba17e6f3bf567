"""scratch.py: a slot's directories are empty and real for every job, and never shared."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from daemon.job import JobState
from daemon.queue.job_queue import JobQueue
from daemon.worker.runner import JobRun
from daemon.worker.scratch import SlotDirs
from daemon.worker.spawn import Spawner
from tests.daemon.worker.test_runner import claimed
from tests.support.workers import sh


async def test_a_slot_is_reset_whatever_the_last_job_left(
    spawner: Spawner, queue: JobQueue, tmp_path: Path
) -> None:
    slot = tmp_path / "slot"
    outside = tmp_path / "outside"
    (outside / "secret").mkdir(parents=True)
    # a read-only tree in the cwd, and `out` swapped for a symlink to someone else's files
    messy = "mkdir -p ro/d; touch ro/d/f; chmod -R a-w ro; "
    messy += f'rm -rf "$GPUPOOL_OUTPUT"; ln -s {outside} "$GPUPOOL_OUTPUT"'
    first = await JobRun(
        queue, await claimed(queue, sh(messy)), data_dir=tmp_path, slot_dir=slot, spawner=spawner
    ).run()
    assert first.outcome is not None
    assert first.outcome.state is JobState.SUCCEEDED
    seen = tmp_path / "seen"
    look = f'ls -A . "$GPUPOOL_OUTPUT" > {seen}; test -d "$GPUPOOL_OUTPUT" && ! test -L "$GPUPOOL_OUTPUT"'
    second = await JobRun(
        queue, await claimed(queue, sh(look)), data_dir=tmp_path, slot_dir=slot, spawner=spawner
    ).run()
    assert second.outcome is not None
    assert second.outcome.state is JobState.SUCCEEDED, second.outcome.result["tail"]
    assert seen.read_text().split() == [".:", f"{slot / 'out'}:"]  # both empty
    assert (outside / "secret").is_dir()  # the link was removed, not followed
    assert sorted(p.name for p in slot.rglob("*")) == ["ckpt", "out", "work"]  # all there, all empty


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
