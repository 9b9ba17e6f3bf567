"""A cgroup per slot (daemon/worker/cgroups.py): what a job starts stays in its slot's cgroup and
ends with it, wherever it went; the worker's cgroups go when it goes, and a dead worker's are
removed by the next, never a live one's. Real cgroups: the tests run as root on a kernel with
cgroup v2 (skipped where there is none)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import psutil
import pytest

from daemon.job import JobState
from daemon.queue.job_queue import JobQueue
from daemon.worker import _spawn, cgroups
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


async def test_after_a_job_whose_leftovers_were_killed_the_slot_runs_its_next_jobs(
    queue: JobQueue, tmp_path: Path
) -> None:
    """Writing cgroup.kill leaves a mark on the cgroup: on this kernel (6.18) every process born
    in it by clone3 afterwards is SIGKILLed at birth. The slot's next jobs must run all the same."""
    async with running_worker(queue, tmp_path / "w", slots=1):
        leaky, _ = await queue.enqueue(sh("sleep 60 & echo started"))  # killed when it ends
        assert (await wait_state(queue, leaky, JobState.SUCCEEDED)).state is JobState.SUCCEEDED
        for _ in range(3):
            job_id, _ = await queue.enqueue(sh("echo ran"))
            info = await wait_state(queue, job_id, JobState.SUCCEEDED, JobState.FAILED)
            assert (info.state, info.detail) == (JobState.SUCCEEDED, "")


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


def v2_line(proc_cgroup: str) -> str:
    """The cgroup v2 line of a /proc/PID/cgroup ("0::/PATH"), its root "/" as ""."""
    (line,) = [line for line in proc_cgroup.splitlines() if line.startswith("0::")]
    return line.rstrip("/")


def test_a_job_is_born_in_its_cgroup_and_never_runs_outside_one(tmp_path: Path) -> None:
    """_spawn.c starts a job in its slot's cgroup (clone3 into it where the kernel can; joining it
    is ~12 ms a job on an idle machine). What the job sees of itself is that cgroup; and a cgroup
    it cannot be put in fails the start: never a job running outside its slot's cgroup."""
    base = cgroups.own_cgroup()
    assert base is not None
    slot = base / f"test-born-{os.getpid()}"
    slot.mkdir()
    out = tmp_path / "cgroup"
    devnull = os.open(os.devnull, os.O_RDONLY)
    cgroup_dir = os.open(slot, os.O_RDONLY | os.O_DIRECTORY)
    not_a_cgroup = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for born_in in (True, True, False):  # born in it, again, and joining it
            with out.open("wb") as sink:
                pid, pidfd = _spawn.spawn(
                    [b"/bin/sh"], [b"sh", b"-c", b"cat /proc/self/cgroup"], [], b"/", devnull,
                    sink.fileno(), -1, -1, cgroup_dir, born_in, -100, [], False, False,
                )  # fmt: skip
                assert _spawn.reap(pid, pidfd, True) == (0, 0, None)
                os.close(pidfd)
            ours = v2_line(Path("/proc/self/cgroup").read_text())
            assert v2_line(out.read_text()) == f"{ours}/{slot.name}"
        # born there refused (EBADF); or, on a kernel without clone3 into a cgroup, no cgroup.procs
        children = {p.pid for p in psutil.Process().children()}
        started: tuple[int | None, int | None] | None
        try:
            pid, pidfd = _spawn.spawn(
                [b"/bin/true"], [b"true"], [], b"/", devnull, 1, -1, -1, not_a_cgroup, True, -100,
                [], False, False,
            )  # fmt: skip
            reaped = _spawn.reap(pid, pidfd, True)
            started = reaped[:2] if reaped is not None else None
            os.close(pidfd)
        except OSError as exc:
            started = (None, exc.errno)
        assert started in {(None, errno.EBADF), (127, errno.ENOENT)}  # it never ran `true`
        assert {p.pid for p in psutil.Process().children()} == children  # nothing left, or to reap
    finally:
        for fd in (devnull, cgroup_dir, not_a_cgroup):
            os.close(fd)
        slot.rmdir()
