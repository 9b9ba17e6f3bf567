"""spawn.py and launcher.py: a job's first process, under either event loop (conftest runs this
module on both)."""

from __future__ import annotations

import asyncio
import errno
import gc
import os
import signal
from pathlib import Path

import pytest

from daemon.worker import launcher as launcher_module
from daemon.worker.spawn import Launcher


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_output_status_and_a_session_of_its_own(launcher: Launcher, tmp_path: Path) -> None:
    child = await launcher.spawn(
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


async def test_a_signal_is_a_negative_status_and_wait_survives_a_cancelled_waiter(
    launcher: Launcher, tmp_path: Path
) -> None:
    child = await launcher.spawn(["sleep", "300"], cwd=tmp_path, env={"PATH": os.environ["PATH"]})
    waiter = asyncio.ensure_future(child.wait())
    await asyncio.sleep(0.05)
    waiter.cancel()
    os.killpg(child.pid, signal.SIGKILL)
    assert await asyncio.wait_for(child.wait(), 10) == -signal.SIGKILL
    child.close()
    assert not Path(f"/proc/{child.pid}").exists()  # reaped by the launcher: no zombie left


def processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


async def gone(marker: str) -> list[int]:
    """The processes with `marker` in their argv, once there are none or after 5 s."""
    for _ in range(100):
        if not processes_with(marker):
            break
        await asyncio.sleep(0.05)
    return processes_with(marker)


async def test_a_job_holds_only_its_output_and_the_default_signal_dispositions(
    launcher: Launcher, tmp_path: Path
) -> None:
    """The launcher's socket starts any program as any uid: a job holding it would be root."""
    child = await launcher.spawn(
        ["sh", "-c", "ls /proc/$$/fd; exec grep -E '^Sig(Ign|Blk)' /proc/self/status"],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"]},
    )
    lines = (await child.stdout.read()).decode().split()
    assert await child.wait() == 0
    child.close()
    assert lines[:4] == ["0", "1", "2", "SigBlk:"], lines  # nothing beyond 0-2
    standard = (1 << 31) - 1  # signals 1-31; glibc keeps 32 and 33 for itself, out of reach
    blocked, ignored = int(lines[4], 16), int(lines[6], 16)
    assert lines[5] == "SigIgn:"
    assert blocked == 0, lines
    assert ignored & standard == 0, lines  # SIGPIPE, SIGINT, ... as a program expects them


async def test_a_large_environment_and_bytes_that_are_not_utf8_arrive_exactly(
    launcher: Launcher, tmp_path: Path
) -> None:
    big = "x" * 100_000  # several datagrams (one string may hold 128 KiB)
    odd = os.fsdecode(b"caf\xe9")  # latin-1, as os.environ gives it (surrogateescape)
    child = await launcher.spawn(
        ["sh", "-c", 'printf %s "$BIG" | wc -c; printf %s "$ODD"'],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"], "BIG": big, "ODD": odd},
    )
    assert await child.stdout.read() == b"100000\ncaf\xe9"
    assert await child.wait() == 0
    child.close()


async def test_a_spawn_cancelled_while_it_starts_leaves_no_process(
    launcher: Launcher, tmp_path: Path
) -> None:
    marker = f"300.{os.getpid()}1"
    for _ in range(5):
        task = asyncio.ensure_future(
            launcher.spawn(["sleep", marker], cwd=tmp_path, env={"PATH": os.environ["PATH"]})
        )
        await asyncio.sleep(0)  # sent, not answered
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    # Requests are handled in order: by the time a later job has run, the cancelled ones started.
    later = await launcher.spawn(["sleep", "0.3"], cwd=tmp_path, env={"PATH": os.environ["PATH"]})
    await later.wait()
    later.close()
    assert await gone(marker) == []


async def test_when_the_launcher_dies_its_jobs_are_killed_and_a_new_one_serves(tmp_path: Path) -> None:
    launcher = Launcher()
    await launcher.start()
    watch = asyncio.ensure_future(launcher.watch_over())
    try:
        marker = f"300.{os.getpid()}2"
        child = await launcher.spawn(["sleep", marker], cwd=tmp_path, env={"PATH": os.environ["PATH"]})
        assert launcher._proc is not None
        launcher._proc.kill()
        assert await asyncio.wait_for(child.wait(), 10) == -signal.SIGKILL
        child.close()
        assert await gone(marker) == []
        for _ in range(100):  # a new launcher, started by the watch
            try:
                again = await launcher.spawn(
                    ["sh", "-c", "exit 4"], cwd=tmp_path, env={"PATH": os.environ["PATH"]}
                )
                break
            except OSError:
                await asyncio.sleep(0.05)
        assert await asyncio.wait_for(again.wait(), 10) == 4
        again.close()
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await launcher.stop()


async def test_a_program_that_cannot_start_raises_oserror_and_leaks_nothing(
    launcher: Launcher, tmp_path: Path
) -> None:
    before = open_fds()
    with pytest.raises(FileNotFoundError):
        await launcher.spawn(["no-such-program-xyz"], cwd=tmp_path, env={"PATH": os.environ["PATH"]})
    with pytest.raises(FileNotFoundError):
        await launcher.spawn(["true"], cwd=tmp_path / "missing", env={"PATH": os.environ["PATH"]})
    assert open_fds() == before


async def test_a_request_no_exec_could_take_is_refused_and_the_launcher_serves_on(
    launcher: Launcher, tmp_path: Path
) -> None:
    """A NUL byte in a path, argument or variable (the server refuses such a spec; this is the
    launcher's own guard): that request fails with EINVAL, and the launcher, which every job of
    the worker needs, goes on."""
    env = {"PATH": os.environ["PATH"]}
    for argv, cwd, extra in (
        (["true"], Path(f"{tmp_path}/a\x00b"), {}),
        (["echo", "a\x00b"], tmp_path, {}),
        (["true"], tmp_path, {"A": "x\x00y"}),
    ):
        with pytest.raises(OSError, match="Invalid argument") as err:
            await launcher.spawn(argv, cwd=cwd, env={**env, **extra})
        assert err.value.errno == errno.EINVAL
    await run_true(launcher, tmp_path)


async def run_true(launcher: Launcher, tmp_path: Path) -> None:
    child = await launcher.spawn(["true"], cwd=tmp_path, env={})
    await child.stdout.read()
    assert await child.wait() == 0
    child.close()
    for _ in range(3):
        await asyncio.sleep(0)  # a pipe transport closes at a later turn


async def test_many_processes_leave_no_descriptors_open(launcher: Launcher, tmp_path: Path) -> None:
    await run_true(launcher, tmp_path)  # the loop may open what it keeps (uvloop: /dev/null)
    before = open_fds()
    for _ in range(20):
        await run_true(launcher, tmp_path)
    assert open_fds() == before


def test_an_entry_that_goes_between_listing_and_looking_is_not_the_uids(tmp_path: Path) -> None:
    """Another job's churn in /tmp must not make the sweep give up on the whole directory."""
    (tmp_path / "gone").write_text("x")
    with os.scandir(tmp_path) as scan:
        entries = list(scan)
    (tmp_path / "gone").unlink()
    assert [launcher_module._owned_by(e, os.getuid()) for e in entries] == [False]


async def test_a_spawn_that_fails_once_its_pipe_is_wrapped_closes_the_pipe_once(
    launcher: Launcher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The output pipe, once wrapped in a file object, is that object's to close: closing its
    descriptor by hand as well let the object's finalizer close it again later, when the number
    may be another file's (someone's upload, say)."""

    def refuse() -> asyncio.StreamReaderProtocol:
        raise OSError(errno.EMFILE, "no room for the pipe's transport")

    monkeypatch.setattr(asyncio, "StreamReaderProtocol", lambda *_: refuse())
    with pytest.raises(OSError, match="no room"):
        await launcher.spawn(["sleep", "30"], cwd=tmp_path, env={"PATH": os.environ["PATH"]})
    monkeypatch.undo()
    with (tmp_path / "another").open("wb", buffering=0) as another:  # the lowest free number
        gc.collect()  # where the wrapped pipe, if left open, is finalized
        another.write(b"still mine")
    assert (tmp_path / "another").read_bytes() == b"still mine"
