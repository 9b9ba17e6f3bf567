"""A job's first process, started at the cost of an exec whatever the worker's size or event loop.

asyncio's own subprocesses fork the whole worker when the loop is uvloop (libuv always forks) or
when a `preexec_fn` is given, and a fork copies the page tables of a process that may hold
hundreds of MB: on a 300 MB parent that is ~20 ms per job, against ~1 ms for an exec. Here the
process is started by `subprocess.Popen` without `preexec_fn`, which CPython does with vfork, in a
new session (its own process group, so one `killpg` reaches all it starts). Its end is watched
with a pidfd registered with the running loop (Linux >= 5.3; where there is none, or a seccomp
filter refuses it, a thread per process waits instead), its output read through the loop's pipe
transport: no SIGCHLD handler, nothing the loop must support beyond `add_reader` and
`connect_read_pipe`. A job's processes outliving a killed worker are
orphan_guard.py's to kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from daemon.worker.identity import ROOT_ENV, SlotIdentity


class Child:
    """A started process: `pid`, its merged stdout+stderr as `stdout`, `await wait()` for its status,
    `close()` the output pipe once read (uvloop keeps a pipe open after end of file)."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        stdout: asyncio.StreamReader,
        pipe: asyncio.BaseTransport,
        pidfd: int,
    ) -> None:
        self.pid = popen.pid
        self.stdout = stdout
        self._pipe = pipe
        self.returncode: int | None = None
        self._popen = popen
        self._pidfd = pidfd
        self._loop = asyncio.get_running_loop()
        self._ended: asyncio.Future[int] = self._loop.create_future()
        if pidfd >= 0:
            self._loop.add_reader(pidfd, self._exited)
        else:
            threading.Thread(target=self._wait_in_thread, name=f"wait {popen.pid}", daemon=True).start()

    def _exited(self) -> None:
        """The pidfd is readable: the process has ended, so reaping it does not block."""
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._ended_with(self._popen.wait())

    def _wait_in_thread(self) -> None:
        code = self._popen.wait()
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
            self._loop.call_soon_threadsafe(self._ended_with, code)

    def _ended_with(self, code: int) -> None:
        self.returncode = code
        if not self._ended.done():
            self._ended.set_result(code)

    async def wait(self) -> int:
        """The exit status (-N: killed by signal N). Cancelling the wait leaves the watch in place."""
        return await asyncio.shield(self._ended)

    def close(self) -> None:
        """Stop reading the output pipe (whoever still holds its other end gets EPIPE)."""
        self._pipe.close()


async def start(
    argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], identity: SlotIdentity | None = None
) -> Child:
    """Start `argv` (no shell) in `cwd` with exactly `env`, stdin from /dev/null, stdout and stderr
    into one pipe, as `identity` when given (through setpriv and env: the child changes no
    credentials itself, so it is still a vfork). Raises OSError when it cannot start (no such
    program, no such directory; with an identity, env says so and exits 125 or 127)."""
    if identity is not None:  # setpriv, root until it switches, gets nothing of the job's
        argv, env, cwd = identity.wrap(argv, env, cwd), ROOT_ENV, Path("/")
    popen = subprocess.Popen(  # noqa: ASYNC220 - vfork + exec: as long as an exec takes
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        env=dict(env),
        start_new_session=True,
    )
    assert popen.stdout is not None
    pidfd = -1
    try:
        with contextlib.suppress(OSError):  # none: Child waits in a thread
            pidfd = os.pidfd_open(popen.pid)
        reader = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        pipe, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), popen.stdout)
    except BaseException:
        os.killpg(popen.pid, signal.SIGKILL)
        popen.stdout.close()
        if pidfd >= 0:
            os.close(pidfd)
        await asyncio.to_thread(popen.wait)
        raise
    return Child(popen, reader, pipe, pidfd)
