"""procguard.py: when the worker is gone, so are its jobs, announced or not."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from daemon.procguard import OrphanGuard
from tests.workers import alive, wait_dead


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
