"""spawn.py: a job's first process under either event loop (conftest runs this module on both)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from daemon.worker.spawn import start


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_output_status_and_a_session_of_its_own(tmp_path: Path) -> None:
    child = await start(
        ["sh", "-c", 'echo "out $A $(pwd)"; echo err >&2; ps -o sid= -p $$; exit 3'],
        cwd=tmp_path,
        env={"A": "1", "PATH": os.environ["PATH"]},
    )
    output = await child.stdout.read()
    assert await child.wait() == 3
    child.close()
    lines = output.decode().split("\n")
    assert lines[:2] == [f"out 1 {tmp_path}", "err"]
    assert int(lines[2]) == child.pid  # it leads a new session, so its group is its own
    assert child.returncode == 3


async def test_a_signal_is_a_negative_status_and_wait_survives_a_cancelled_waiter(tmp_path: Path) -> None:
    child = await start(["sleep", "300"], cwd=tmp_path, env={"PATH": os.environ["PATH"]})
    waiter = asyncio.ensure_future(child.wait())
    await asyncio.sleep(0.05)
    waiter.cancel()
    os.killpg(child.pid, signal.SIGKILL)
    assert await asyncio.wait_for(child.wait(), 10) == -signal.SIGKILL
    child.close()
    with pytest.raises(ChildProcessError):  # reaped: no zombie left behind
        os.waitpid(child.pid, os.WNOHANG)


async def test_without_pidfds_a_thread_waits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(pid: int) -> int:
        raise PermissionError(1, "pidfd_open refused by a seccomp filter")

    monkeypatch.setattr(os, "pidfd_open", refused)
    child = await start(["sh", "-c", "echo hi; exit 7"], cwd=tmp_path, env={"PATH": os.environ["PATH"]})
    assert await child.stdout.read() == b"hi\n"
    assert await asyncio.wait_for(child.wait(), 10) == 7
    child.close()
    with pytest.raises(ChildProcessError):
        os.waitpid(child.pid, os.WNOHANG)


async def test_a_program_that_cannot_start_raises_oserror_and_leaks_nothing(tmp_path: Path) -> None:
    before = open_fds()
    with pytest.raises(FileNotFoundError):
        await start(["no-such-program-xyz"], cwd=tmp_path, env={"PATH": os.environ["PATH"]})
    with pytest.raises(FileNotFoundError):
        await start(["true"], cwd=tmp_path / "missing", env={"PATH": os.environ["PATH"]})
    assert open_fds() == before


async def run_true(tmp_path: Path) -> None:
    child = await start(["true"], cwd=tmp_path, env={})
    await child.stdout.read()
    assert await child.wait() == 0
    child.close()
    for _ in range(3):
        await asyncio.sleep(0)  # a pipe transport closes at a later turn


async def test_many_processes_leave_no_descriptors_open(tmp_path: Path) -> None:
    await run_true(tmp_path)  # the loop may open what it keeps (uvloop: /dev/null)
    before = open_fds()
    for _ in range(20):
        await run_true(tmp_path)
    assert open_fds() == before
