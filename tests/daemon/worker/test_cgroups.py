"""A cgroup per slot (daemon/worker/cgroups.py): what a job starts stays in its slot's cgroup and
ends with it, wherever it went; the worker's cgroups go when it goes, and a dead worker's are
removed by the next, never a live one's. Real cgroups: the tests run as root on a kernel with
cgroup v2 (skipped where there is none)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from daemon.job import JobState
from daemon.queue.job_queue import JobQueue
from daemon.worker import cgroups
from tests.support.workers import running_worker, sh, wait_dead, wait_file, wait_state


def usable() -> bool:
    base = cgroups.own_cgroup()
    return os.geteuid() == 0 and base is not None and os.access(base, os.W_OK)


pytestmark = pytest.mark.skipif(not usable(), reason="needs root and a cgroup v2 hierarchy")


async def test_a_jobs_escapes_stay_in_its_slots_cgroup_and_end_with_it(
    queue: JobQueue, tmp_path: Path
) -> None:
    """Root worker, no uid range: the cgroup alone catches what left the job's session."""
    async with running_worker(queue, tmp_path / "w", slots=1) as worker:
        assert worker._slots.cgroups is not None
        slot = worker._slots.cgroups.path(0)
        script = f"setsid -f env -i sh -c 'echo $$ > {tmp_path}/escaped; exec sleep 120'; sleep 0.5"
        job_id, _ = await queue.enqueue(sh(script))
        escaped = int((await wait_file(tmp_path / "escaped"))[0])
        assert escaped in cgroups.pids(slot)  # out of the session, not out of the cgroup
        assert (await wait_state(queue, job_id, JobState.SUCCEEDED)).state is JobState.SUCCEEDED
        await wait_dead([escaped], timeout=5)  # escaped with setsid and env -i: gone with its job
        assert cgroups.pids(slot) == []
        top = worker._slots.cgroups.top
        assert top.is_dir()
    assert not top.exists()  # the worker's cgroups went with it


async def test_a_dead_workers_cgroups_are_removed_and_a_live_ones_kept(
    queue: JobQueue, tmp_path: Path
) -> None:
    async with running_worker(queue, tmp_path / "w", slots=1) as live:
        assert live._slots.cgroups is not None
        base = live._slots.cgroups.top.parent
        # What a SIGKILLed worker leaves: its slot directories (unlocked) and its cgroups.
        (tmp_path / "w" / "slots" / "dead-worker" / "0").mkdir(parents=True)
        (base / "gpupool-dead-worker" / "slot-0").mkdir(parents=True)
        async with running_worker(queue, tmp_path / "w", slots=1) as other:
            assert other._slots.cgroups is not None
            assert not (base / "gpupool-dead-worker").exists()
            assert live._slots.cgroups.top.is_dir()  # the live one's: its slot dirs are locked
            job_id, _ = await queue.enqueue(sh("echo still here"))
            assert (await wait_state(queue, job_id, JobState.SUCCEEDED)).state is JobState.SUCCEEDED
