"""Issue 49: `poolctl shell` and `poolctl attach`, end to end: a real pool server, a real `poold
--worker` process with made-up GPUs running jobs as slot uids (test_exec.py's), and `poolctl` as
a subprocess on a real PTY (pexpect), typed into as a researcher types."""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeAlias

import pexpect

from daemon.ctl.job_shell import Escape
from daemon.job import JobSpec, JobState
from daemon.queue import registry
from daemon.queue.embedded_redis import EmbeddedRedis
from tests.daemon.ctl.test_exec import gpu_worker, log_text
from tests.support.paths import ROOT
from tests.support.pool import Pool, running_pool
from tests.support.poolctl import poolctl
from tests.support.workers import wait_state, wait_until

PROMPT = "@@ "  # the shell's prompt, which no command typed here echoes
# bash takes its prompt from the environment; nothing of the worker's startup files runs
SHELL = ["--", "sh", "-c", f"PS1='{PROMPT}' exec bash --norc --noprofile -i"]
QUEUED = r"poolctl: (\S+) queued"
Terminal: TypeAlias = "pexpect.spawn[str]"  # poolctl on a PTY, its output read as text


@asynccontextmanager
async def pool_and_worker(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> AsyncIterator[Pool]:
    async with running_pool(redis_server, tmp_path) as pool:
        with gpu_worker(redis_server, tmp_path / "worker.log", s3_env):

            async def registered() -> bool:
                return len(await registry.list_workers(pool.queue.redis)) == 1

            await wait_until(registered, 30, "the worker to register")
            yield pool


def poolctl_on_a_pty(pool: Pool, user: str, *args: str) -> Terminal:
    """`poolctl ARGS` as `user`, its terminal a PTY of 24x80 that the test types into."""
    env = {**pool.env(user), "PYTHONPATH": str(ROOT), "TERM": "dumb"}
    return pexpect.spawn(
        sys.executable,
        ["-m", "daemon.ctl.cli", *args],
        env=env,
        cwd="/",
        dimensions=(24, 80),
        timeout=30,
        encoding="utf-8",
        codec_errors="replace",
    )


async def expect(child: Terminal, pattern: str | type[pexpect.EOF], timeout: float = 15) -> str:
    """Wait (off the loop, which serves the pool) for `pattern` in what the PTY shows; its first
    group, if it has one."""
    await asyncio.to_thread(child.expect, pattern, timeout=timeout)
    found = child.match
    return str(found[1]) if isinstance(found, re.Match) and found.re.groups else ""


async def ended(child: Terminal) -> int:
    """poolctl's exit status, once it has ended."""
    await expect(child, pexpect.EOF)
    await asyncio.to_thread(child.wait)
    assert "Traceback" not in (child.before or "")
    if child.exitstatus is None:
        assert child.signalstatus is not None
        return 128 + child.signalstatus
    return int(child.exitstatus)


async def test_shell_types_resizes_interrupts_detaches_reattaches_exits_with_its_code_and_idles_out(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    """Issue 49, `shell` done-when, through a real PTY: `poolctl shell` queues a job whose shell
    runs on a terminal in its allocation: a command typed is run (`echo $((6*7))` shows 42); the
    local window's resize reaches it (`stty size`); Ctrl-C interrupts its foreground command and
    the shell lives on, Ctrl-Z stops one; a client that reads nothing holds it back; `Enter ~ .`
    detaches (poolctl exits 0, saying how to return) and the shell runs on (its output then
    blocks it nowhere); `poolctl attach` returns to the same shell, replaying the end of what it
    showed (a variable set before is still set), and another attach takes it over, telling the
    one before; bob's attach is refused (exit 6), and so is an attach to a job without a
    terminal; a shell that has to wait says why, and Ctrl-C then cancels it; `exit 3` ends
    poolctl with 3 and the job with exit code 3. Then a shell with `--idle 2` that nobody types
    into ends by itself, saying why in its log, and frees its slot for the job waiting for it."""
    async with pool_and_worker(redis_server, tmp_path, s3_env) as pool:
        queue = pool.queue
        shell = poolctl_on_a_pty(pool, "alice", "shell", "--gpus", "1", *SHELL)
        job_id = await expect(shell, QUEUED)
        await expect(shell, PROMPT)

        shell.sendline('echo $((6*7)); test -O "$(tty)" && echo tty-of-its-uid-$((2*2))')
        await expect(shell, "42\r\n")  # (what was typed holds no 42)
        await expect(shell, "tty-of-its-uid-4")  # its terminal is its own, as a login's is

        shell.setwinsize(33, 101)  # the kernel tells poolctl (SIGWINCH), which tells the job's terminal
        await asyncio.sleep(0.3)
        shell.sendline("stty size")
        await expect(shell, "33 101\r\n")

        shell.sendline("sleep 100; echo not-interrupted")
        await asyncio.sleep(0.5)
        shell.sendcontrol("c")  # a byte to the job's terminal, whose line discipline interrupts sleep
        await expect(shell, PROMPT, timeout=10)
        shell.sendline("echo alive-$((1+1))")
        await expect(shell, "alive-2")
        assert "\nnot-interrupted" not in (shell.before or "")  # (its echo is not its output)
        shell.sendline("sleep 101")
        await asyncio.sleep(0.3)
        shell.sendcontrol("z")  # the same way, SIGTSTP: the shell's job control stops it
        await expect(shell, r"Stopped\s+sleep 101")
        shell.sendline("kill -9 %1")

        # Attached, a client that reads nothing holds the shell back (its window), as ssh's does:
        # of 2 MB, what the windows and buffers on the way hold is read (0.7 MB here), no more
        # (unheld, all of it is in the log by now).
        shell.sendline("seq 1 300000; echo held-$((4+4))")
        await asyncio.sleep(0.6)
        log = await log_text(queue, job_id)
        assert "held-8" not in log
        assert len(log) < 1_600_000
        await asyncio.to_thread(shell.expect, "held-8", timeout=30, searchwindowsize=64)  # read: it goes on

        # A plain job alongside, in the worker's other slot: no terminal to attach to.
        plain, _ = await queue.enqueue(JobSpec(argv=("sleep", "60"), gpus=1, user="alice"))
        await wait_state(queue, plain, JobState.RUNNING)
        refused = poolctl_on_a_pty(pool, "alice", "attach", plain)
        await expect(refused, f"job {plain} has no terminal")
        assert await ended(refused) == 2

        # Both slots taken: a third shell waits, saying why, and Ctrl-C cancels it.
        queued = poolctl_on_a_pty(pool, "alice", "shell", "--gpus", "1")
        queued_id = await expect(queued, QUEUED)
        await expect(queued, f"poolctl: {queued_id} waits: ")
        queued.sendcontrol("c")
        assert await ended(queued) == 130
        assert (await queue.get(queued_id)).state is JobState.CANCELLED

        # Detached, the shell goes on: what it writes then (590 kB, past any window or buffer) holds
        # it up nowhere, and its end is in the tail an attach replays.
        shell.sendline("KEPT=kept-$((2+3)); sleep 0.3; seq 1 100000; echo finished-$((3*3))")
        shell.send("~.")  # first on a line (after the Enter above): ssh's escape
        await expect(shell, f"detached: poolctl attach {job_id} to return")
        assert await ended(shell) == 0
        assert (await queue.get(job_id)).state is JobState.RUNNING  # the shell lives on

        bob = poolctl_on_a_pty(pool, "bob", "attach", job_id)
        assert await ended(bob) == 6

        again = poolctl_on_a_pty(pool, "alice", "attach", job_id)
        await expect(again, "finished-9")  # the session's tail replayed
        again.sendline('echo "[$KEPT]"')
        await expect(again, r"\[kept-5\]")

        third = poolctl_on_a_pty(pool, "alice", "attach", job_id)  # one client at a time: it takes over
        await expect(third, r"\[kept-5\]")
        await expect(again, "detached: attached elsewhere")
        assert await ended(again) == 0
        third.sendline("exit 3")
        assert await ended(third) == 3
        info = await wait_state(queue, job_id, JobState.FAILED)
        assert info.exit_code == 3
        log = await log_text(queue, job_id)
        assert "42" in log  # the session is the job's output
        assert log.count("attach by alice") == 3

        # The idle limit: a shell nobody types into ends, and its slot takes the job that waits.
        idle = poolctl_on_a_pty(pool, "alice", "shell", "--gpus", "1", "--idle", "2")
        idle_id = await expect(idle, QUEUED)
        await wait_state(queue, idle_id, JobState.RUNNING)
        waiting, _ = await queue.enqueue(JobSpec(argv=("true",), gpus=1, user="alice"))
        await asyncio.sleep(0.5)
        assert (await queue.get(waiting)).state is JobState.QUEUED  # both slots are taken
        await expect(idle, f"poolctl: {idle_id}: ended: no input for 2 s")  # (review 49b finding 6)
        assert await ended(idle) == 128 + 1  # its shell hung up (SIGHUP: a shell's stop signal)
        info = await wait_state(queue, idle_id, JobState.FAILED)
        assert "no input for 2 s" in info.detail
        assert "ended: no input for 2 s" in await log_text(queue, idle_id)
        await wait_state(queue, waiting, JobState.SUCCEEDED, timeout=15)
        await queue.cancel(plain)


def test_the_escape_is_a_tilde_first_on_a_line_then_a_dot_and_anything_else_is_typed() -> None:
    """Issue 49, `shell`'s detach (ssh's escape): `~.` detaches only first on a line (at the
    start, or after Enter), dropping what follows it; `~~` types one `~`; a `~` before anything
    else, or anywhere but first on a line, is typed as it is, even split across reads."""
    assert Escape().feed(b"~.rest") == (b"", True)
    assert Escape().feed(b"ls\r~.") == (b"ls\r", True)
    assert Escape().feed(b"ls\n~.") == (b"ls\n", True)
    assert Escape().feed(b"a~.b") == (b"a~.b", False)
    assert Escape().feed(b"~~.") == (b"~.", False)
    assert Escape().feed(b"~x") == (b"~x", False)
    split = Escape()
    assert split.feed(b"\r~") == (b"\r", False)
    assert split.feed(b".") == (b"", True)


async def test_shell_and_attach_refuse_a_stdin_that_is_no_terminal_before_connecting(tmp_path: Path) -> None:
    """Issue 49: `shell` and `attach` need a terminal (a pipe or a file is `exec`'s): refused with a
    sentence saying what to use instead and exit 2, before asking any server (there is none here)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GPUPOOL_SERVER": "127.0.0.1:9"}
    for args in (("shell", "--gpus", "1"), ("attach", "default.0mzk4g8x1a2b")):
        code, out, err = await poolctl(env, *args)
        assert (code, out) == (2, "")
        assert f"{args[0]} needs a terminal on its stdin" in err
        assert "poolctl exec JOB -- COMMAND" in err
