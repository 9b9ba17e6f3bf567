"""The orphan guard: a tiny helper process that kills a worker's jobs if the worker dies.

A job's processes would otherwise outlive a killed worker as orphans (a shell's background
children, a training script's data-loader processes), holding GPUs no one will ever hand out. The
worker tells the guard each job's process group as the job starts and after its processes are
gone (`+PGID` / `-PGID` lines on the guard's stdin). When the guard's stdin reaches end of file,
because the worker exited and the kernel closed its end of the pipe (SIGKILL included), the guard
SIGKILLs every group still listed, then every process whose environment carries this worker's
`GPUPOOL_WORKER=ID` (runner.job_env sets it): that covers a job the worker started but died
before announcing, and descendants that moved to a group of their own. Then it exits. (A kernel
death signal, PR_SET_PDEATHSIG, would need a preexec_fn and so a full fork of the worker per job:
see spawn.py.)

The guard runs in its own session, so a Ctrl-C or a SIGTERM meant for the worker does not stop it
first: it leaves when the worker has left, never before. It has no death signal of its own for the
same reason. The pipe is close-on-exec in the worker, so no job inherits it and keeps it open.
"""

from __future__ import annotations

import asyncio
import logging
import sys

log = logging.getLogger(__name__)

GUARD_SOURCE = r"""
import os, signal, sys
mark = sys.argv[1].encode()
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
groups, buf = set(), b""
while True:
    data = os.read(0, 4096)
    if not data:
        break
    *lines, buf = (buf + data).split(b"\n")
    for line in lines:
        if line[:1] == b"+":
            groups.add(int(line[1:]))
        elif line[:1] == b"-":
            groups.discard(int(line[1:]))
for group in groups:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
for _ in range(3):  # again, for any that forked while the last pass ran
    marked = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
            os.kill(int(name), signal.SIGKILL)
            marked += 1
        except OSError:
            pass
    if not marked:
        break
"""


class OrphanGuard:
    """The worker's side of the guard. `start()` once, `watch`/`forget` per job, `stop()` at the end.
    `mark` is the environment entry every job of this worker carries (`GPUPOOL_WORKER=ID`)."""

    def __init__(self, mark: str) -> None:
        self.mark = mark
        self._proc: asyncio.subprocess.Process | None = None
        self._broken = False

    async def start(self) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-c",
            GUARD_SOURCE,
            self.mark,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )

    def watch(self, pgid: int) -> None:
        """Kill process group `pgid` if the worker dies before `forget(pgid)`."""
        self._send(f"+{pgid}\n")

    def forget(self, pgid: int) -> None:
        """The group's processes are gone: the id may be reused by someone else's group."""
        self._send(f"-{pgid}\n")

    def _send(self, line: str) -> None:
        if self._proc is None or self._proc.stdin is None or self._broken:
            return
        try:
            # A few bytes into a pipe the guard keeps reading: never blocks for long enough to
            # matter, so no drain() and the callers stay synchronous.
            self._proc.stdin.write(line.encode())
        except (BrokenPipeError, ConnectionResetError, RuntimeError) as exc:
            self._broken = True
            log.error("the orphan guard is gone (%s): a killed worker may leave job processes behind", exc)

    async def stop(self) -> None:
        """Close the guard's stdin (it kills any group still listed) and wait for it. Safe twice."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()
        await proc.wait()
