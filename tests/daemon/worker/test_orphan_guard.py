"""orphan_guard.py: when the worker is gone, so are its jobs, announced or not."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from daemon.worker.attempt import boottime
from daemon.worker.orphan_guard import OrphanGuard
from tests.support import uids
from tests.support.workers import alive, wait_dead, wait_until


def start(env: dict[str, str], *, new_session: bool = True) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "300"], env={**os.environ, **env}, start_new_session=new_session)


async def test_the_guard_kills_watched_groups_and_every_process_carrying_its_mark(tmp_path: Path) -> None:
    guard = OrphanGuard("GPUPOOL_WORKER=w-guard-test")
    await guard.start()
    watched = start({})  # announced: killed by group
    unannounced = start({"GPUPOOL_WORKER": "w-guard-test"})  # the worker died before telling
    other_worker = start({"GPUPOOL_WORKER": "w-guard-test-2"})  # another worker's job
    bystander = start({})
    guard.watch(watched.pid)
    try:
        await guard.stop()  # end of file on its stdin, as when the worker is SIGKILLed
        for p in (watched, unannounced):
            p.wait(10)  # reaped here: they are this test's children
        await wait_dead([watched.pid, unannounced.pid])
        assert alive(other_worker.pid)
        assert alive(bystander.pid)
    finally:
        for p in (watched, unannounced, other_worker, bystander):
            p.kill()
            p.wait()


async def test_a_forgotten_group_is_left_alone(tmp_path: Path) -> None:
    guard = OrphanGuard("GPUPOOL_WORKER=w-guard-test-3")
    await guard.start()
    done = start({})
    guard.watch(done.pid)
    guard.forget(done.pid)  # its job ended; the group id may belong to someone else now
    try:
        await guard.stop()
        assert alive(done.pid)
    finally:
        done.kill()
        done.wait()


async def test_a_guard_that_dies_is_started_again_and_told_everything() -> None:
    """A guard killed by hand (or by the OOM killer) left its worker unguarded for good: its
    watcher starts a new one and tells it the groups it watches."""
    guard = OrphanGuard("GPUPOOL_WORKER=w-guard-test-4")
    await guard.start()
    watcher = asyncio.create_task(guard.watch_over())
    job = start({})
    guard.watch(job.pid)
    first = guard.pid
    assert first is not None
    try:
        os.kill(first, signal.SIGKILL)
        await wait_until(lambda: _replaced(guard, first), what="a new guard")
        await asyncio.sleep(0.2)  # it has read what it was told
        await guard.stop()  # end of file: the new guard kills what it watches
        job.wait(10)
        await wait_dead([job.pid])
    finally:
        watcher.cancel()
        job.kill()
        job.wait()


async def _replaced(guard: OrphanGuard, old: int) -> bool:
    return guard.pid not in (None, old)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching uids needs root")
async def test_when_the_worker_is_gone_so_is_every_process_of_its_slots_uids() -> None:
    guard = OrphanGuard("GPUPOOL_WORKER=w-guard-test-5", uids=(uids.uid(10), uids.uid(11)))
    await guard.start()

    def as_uid(uid: int, *argv: str) -> subprocess.Popen[bytes]:
        setpriv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        return subprocess.Popen([*setpriv, *argv], start_new_session=True)

    escaped = as_uid(uids.uid(11), "env", "-i", "sleep", "300")  # no mark, its own session: only its uid says
    other_uid = as_uid(uids.uid(12), "sleep", "300")
    try:
        slot_uid = uids.uid(11)
        await wait_until(lambda: _running_as(escaped.pid, slot_uid), what="the job to run as its slot's uid")
        await guard.stop()
        escaped.wait(10)
        assert alive(other_uid.pid)  # no slot of this worker's
    finally:
        for p in (escaped, other_uid):
            p.kill()
            p.wait()


async def _running_as(pid: int, uid: int) -> bool:
    return os.stat(f"/proc/{pid}").st_uid == uid


def _frozen_for(seconds: float, pids: list[int]) -> bool:
    """Block the event loop, as a worker SIGSTOPped right after a call returns would be, until
    `pids` are all dead (True) or `seconds` pass (False)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(pid) for pid in pids):
            return True
        time.sleep(0.02)
    return False


async def test_what_the_worker_tells_the_guard_is_with_it_when_the_call_returns() -> None:
    """A worker frozen just after it started a job left the job running beside its next attempt
    (test_liveness's frozen worker, failing under load): the guard's lines waited for the worker's
    next loop turn, which a frozen worker never takes. The deadline and the group are the guard's
    once `hold` and `watch` return."""
    guard = OrphanGuard("GPUPOOL_WORKER=w-guard-test-5")
    await guard.start()
    job = start({})
    try:
        guard.hold("lease-5", boottime() + 0.3)
        guard.watch(job.pid, "lease-5")
        assert _frozen_for(10.0, [job.pid]), "the guard never killed the frozen worker's job"
    finally:
        job.kill()
        job.wait()
        await guard.stop()


async def test_a_lease_past_its_deadline_takes_its_unannounced_processes_too() -> None:
    """Frozen between starting a job and announcing its group, a worker has told the guard only
    the lease's deadline: what carries the lease's mark (runner.job_env's GPUPOOL_ATTEMPT_ID) dies
    with it; another lease's job, and one of another worker, do not."""
    guard = OrphanGuard("GPUPOOL_WORKER=w-guard-test-6")
    await guard.start()
    mine = start({"GPUPOOL_WORKER": "w-guard-test-6", "GPUPOOL_ATTEMPT_ID": "lease-6a"})
    other_lease = start({"GPUPOOL_WORKER": "w-guard-test-6", "GPUPOOL_ATTEMPT_ID": "lease-6b"})
    other_worker = start({"GPUPOOL_WORKER": "w-guard-test-7", "GPUPOOL_ATTEMPT_ID": "lease-6a"})
    try:
        guard.hold("lease-6a", boottime() + 0.3)
        guard.hold("lease-6b", boottime() + 60)
        assert _frozen_for(10.0, [mine.pid]), "the lease's unannounced process outlived its deadline"
        assert alive(other_lease.pid)
        assert alive(other_worker.pid)
    finally:
        for p in (mine, other_lease, other_worker):
            p.kill()
            p.wait()
        await guard.stop()
