"""spawn.py and _spawn.c: a job's first process, started from the worker's loop and reaped there,
under either event loop (conftest runs this module on both)."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from daemon.worker import _spawn, uid_sweep
from daemon.worker.spawn import Child, Spawner

ENV = {"PATH": os.environ["PATH"]}


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


async def output_of(child: Child) -> bytes:
    """Everything the child wrote, until end of file (then the descriptor is closed). Blocking:
    the child runs on without the loop."""
    chunks = []
    try:
        while data := os.read(child.output, 65536):
            chunks.append(data)
    finally:
        os.close(child.output)
    return b"".join(chunks)


async def test_output_status_and_a_session_of_its_own(spawner: Spawner, tmp_path: Path) -> None:
    child = spawner.spawn(
        ["sh", "-c", 'echo "out $A $(pwd)"; echo err >&2; ps -o sid= -p $$; exit 3'],
        cwd=tmp_path,
        env={"A": "1", **ENV},
    )
    output = await output_of(child)
    assert await child.wait() == 3
    lines = output.decode().split("\n")
    assert lines[:2] == [f"out 1 {tmp_path}", "err"]
    assert int(lines[2]) == child.pid  # it leads a new session, so its group is its own
    assert (child.returncode, child.start_error) == (3, None)


async def test_a_signal_is_a_negative_status_and_wait_survives_a_cancelled_waiter(
    spawner: Spawner, tmp_path: Path
) -> None:
    child = spawner.spawn(["sleep", "300"], cwd=tmp_path, env=ENV)
    os.close(child.output)
    waiter = asyncio.ensure_future(child.wait())
    await asyncio.sleep(0.05)
    waiter.cancel()
    os.killpg(child.pid, signal.SIGKILL)
    assert await asyncio.wait_for(child.wait(), 10) == -signal.SIGKILL
    assert not Path(f"/proc/{child.pid}").exists()  # reaped by the worker: no zombie left


async def test_a_job_holds_only_its_output_and_the_default_signal_dispositions(
    spawner: Spawner, tmp_path: Path
) -> None:
    """The child shares the worker's memory until its exec, and is born of a process holding
    Redis connections and the store's credentials: none of it may reach the job."""
    child = spawner.spawn(
        ["sh", "-c", "ls /proc/$$/fd; exec grep -E '^Sig(Ign|Blk)' /proc/self/status"], cwd=tmp_path, env=ENV
    )
    lines = (await output_of(child)).decode().split()
    assert await child.wait() == 0
    assert lines[:4] == ["0", "1", "2", "SigBlk:"], lines  # nothing beyond 0-2
    standard = (1 << 31) - 1  # signals 1-31
    blocked, ignored = int(lines[4], 16), int(lines[6], 16)
    assert lines[5] == "SigIgn:"
    assert blocked == 0, lines
    assert ignored & standard == 0, lines  # SIGPIPE (which Python ignores), ... as a program expects them


async def test_a_large_environment_and_bytes_that_are_not_utf8_arrive_exactly(
    spawner: Spawner, tmp_path: Path
) -> None:
    big = "x" * 100_000
    odd = os.fsdecode(b"caf\xe9")  # latin-1, as os.environ gives it (surrogateescape)
    child = spawner.spawn(
        ["sh", "-c", 'printf %s "$BIG" | wc -c; printf %s "$ODD"'],
        cwd=tmp_path,
        env={**ENV, "BIG": big, "ODD": odd},
    )
    assert await output_of(child) == b"100000\ncaf\xe9"
    assert await child.wait() == 0


@pytest.mark.parametrize(
    ("argv", "where", "code"),
    [
        (["no-such-program-xyz"], "", errno.ENOENT),
        (["true"], "missing", errno.ENOENT),
        (["./not-executable"], "", errno.EACCES),
    ],
)
async def test_a_program_that_cannot_start_ends_saying_why_and_leaks_nothing(
    spawner: Spawner, tmp_path: Path, argv: list[str], where: str, code: int
) -> None:
    (tmp_path / "not-executable").write_text("echo no\n")
    warm = spawner.spawn(["true"], cwd=tmp_path, env=ENV)  # a mapping kept for the next child
    await output_of(warm)
    await warm.wait()
    before = open_fds(), mappings()
    child = spawner.spawn(argv, cwd=tmp_path / where, env=ENV)
    assert await output_of(child) == b""
    assert await child.wait() == 127
    assert child.start_error is not None
    assert child.start_error.errno == code
    assert (open_fds(), mappings()) == before


async def test_a_program_that_exits_127_itself_has_started(spawner: Spawner, tmp_path: Path) -> None:
    child = spawner.spawn(["sh", "-c", "exit 127"], cwd=tmp_path, env=ENV)
    os.close(child.output)
    assert (await child.wait(), child.start_error) == (127, None)


async def test_a_request_no_exec_could_take_is_refused_before_any_process(
    spawner: Spawner, tmp_path: Path
) -> None:
    """A NUL byte in a path, argument or variable (the server refuses such a spec; this is the
    spawner's own guard): EINVAL, and nothing started or left open."""
    before = open_fds()
    for argv, cwd, extra in (
        (["true"], Path(f"{tmp_path}/a\x00b"), {}),
        (["echo", "a\x00b"], tmp_path, {}),
        (["true"], tmp_path, {"A": "x\x00y"}),
    ):
        with pytest.raises(OSError, match="Invalid argument") as err:
            spawner.spawn(argv, cwd=cwd, env={**ENV, **extra})
        assert err.value.errno == errno.EINVAL
    assert open_fds() == before


async def test_many_processes_leave_no_descriptors_or_mappings(spawner: Spawner, tmp_path: Path) -> None:
    """Each child's stack and plan are one mapping of the worker's, unmapped once it has exec'd."""
    for _ in range(3):  # the loop may open what it keeps (uvloop: /dev/null)
        child = spawner.spawn(["true"], cwd=tmp_path, env={})
        await output_of(child)
        await child.wait()
    before = open_fds(), mappings()
    for _ in range(50):
        child = spawner.spawn(["true"], cwd=tmp_path, env={})
        await output_of(child)
        assert await child.wait() == 0
    assert (open_fds(), mappings()) == before


@pytest.mark.parametrize("job_nice", [0, 5])
async def test_a_job_runs_as_much_nicer_than_the_worker_as_configured(tmp_path: Path, job_nice: int) -> None:
    """The pool's own work (heartbeats, claims, Redis) must not be starved by the jobs it runs."""
    spawner = Spawner(job_nice)
    try:
        child = spawner.spawn(["sh", "-c", "ps -o ni= -p $$"], cwd=tmp_path, env=ENV)
        assert int(await output_of(child)) == os.getpriority(os.PRIO_PROCESS, 0) + job_nice
        assert await child.wait() == 0
    finally:
        await spawner.close()


async def test_without_pidfds_a_thread_waits_for_the_job(
    spawner: Spawner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel before 5.2 gives no pidfd: the job is waited for by pid in a thread of its own."""
    real = _spawn.spawn

    def without_pidfd(*args: object) -> tuple[int, int]:
        pid, pidfd = real(*args)  # type: ignore[arg-type]
        os.close(pidfd)
        return pid, -1

    monkeypatch.setattr(_spawn, "spawn", without_pidfd)
    child = spawner.spawn(["sh", "-c", "echo hi; exit 5"], cwd=tmp_path, env=ENV)
    assert await output_of(child) == b"hi\n"
    assert await asyncio.wait_for(child.wait(), 10) == 5
    assert not Path(f"/proc/{child.pid}").exists()


def test_an_entry_that_goes_between_listing_and_looking_is_not_the_uids(tmp_path: Path) -> None:
    """Another job's churn in /tmp must not make the sweep give up on the whole directory."""
    (tmp_path / "gone").write_text("x")
    with os.scandir(tmp_path) as scan:
        entries = list(scan)
    (tmp_path / "gone").unlink()
    assert [uid_sweep.owned_by(e, os.getuid()) for e in entries] == [False]


CHILDREN = ("job_child", "sweeper_child")  # what a child of _spawn.c runs until its exec or exit
ELSEWHERE = "off x86-64 the calling thread waits for the child, which then makes library calls"


@pytest.mark.skipif(os.uname().machine != "x86_64", reason=ELSEWHERE)
def test_a_child_calls_no_library_function_until_its_exec() -> None:
    """issue 44 item 7: the child shares the worker thread's memory and thread-local storage until
    its exec, so it may make only system calls: the first call of a library function goes through
    the dynamic linker, and the keyring listing called memcmp, memmove and strlen. Read from the
    module as built (objdump comes with the binutils that linked it): every function the children
    reach, and what each calls or jumps to."""
    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", _spawn.__file__], capture_output=True, text=True, check=True
    ).stdout
    calls: dict[str, set[str]] = {}
    function = ""
    for line in listing.splitlines():
        if heading := re.fullmatch(r"[0-9a-f]+ <(.+)>:", line):
            function = heading[1]
            calls[function] = set()
        elif instruction := re.search(r"\t(call|jmp)\w*\s+(.*)$", line):
            target = re.search(r"<([^>+]+)", instruction[2])
            calls[function].add(target[1] if target else instruction[2])  # no symbol: indirect
    reached, todo = set(), list(CHILDREN)
    while todo:
        if (function := todo.pop()) not in reached:
            reached.add(function)
            todo.extend(calls.get(function, ()))
    outside = {function for function in reached if "@" in function or function not in calls}
    assert not outside, f"the children call library functions, or through pointers: {outside}"
