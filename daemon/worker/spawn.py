"""Jobs' processes, started, reaped and killed by the launcher (launcher.py) so that the worker's
event loop never forks, execs or waits: this is the worker's side of it.

A fork copies the page tables of the process that forks, and a worker holds hundreds of MB: ~20 ms
a job. vfork copies nothing, but CPython's subprocess gives it up when the child changes
credentials, and a job must run as its slot's uid (identity.py). The launcher is a small process of
the worker's whose one C module (_spawn.c) vforks and switches the uid in the child; it runs beside
the loop, on a core of its own when there is one: the loop sends a request and goes on claiming,
heartbeating and streaming logs. `Launcher.spawn` returns once the job's program has been exec'd
(or raises the OSError that stopped it), with its merged output as a pipe read through the loop;
the launcher tells when it ends. A job's processes outliving a killed worker are orphan_guard.py's
to kill.

If the launcher itself ends (killed by hand, the OOM killer), the worker cannot learn how its
running jobs end: it kills their groups, takes them as killed (-SIGKILL) and starts a new launcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from daemon.errors import GpupoolError
from daemon.worker import launcher
from daemon.worker.identity import SlotIdentity

log = logging.getLogger(__name__)

STOP_SECONDS = 5.0  # how long stop() waits for the launcher to leave before killing it
READY_SECONDS = 30.0  # how long start() waits for a new launcher to say it is ready


class LauncherError(GpupoolError):
    """The job launcher could not be started."""


class Child:
    """A started job's first process: `pid`, its merged stdout+stderr as `stdout`, `await wait()`
    for its status, `close()` the output pipe once read."""

    def __init__(
        self,
        pid: int,
        stdout: asyncio.StreamReader,
        pipe: asyncio.BaseTransport,
        ended: asyncio.Future[tuple[int, list[int]]],
    ):
        self.pid = pid
        self.stdout = stdout
        self._pipe = pipe
        self._ended = ended

    @property
    def returncode(self) -> int | None:
        """The exit status once it has ended, else None."""
        return self._ended.result()[0] if self._ended.done() else None

    @property
    def left(self) -> list[int]:
        """Once it has ended: the pids still in its cgroup when the launcher killed them all
        (dying; the worker waits for them). Empty without a cgroup."""
        return self._ended.result()[1] if self._ended.done() else []

    async def wait(self) -> int:
        """The exit status (-N: killed by signal N). Cancelling the wait leaves the watch in place."""
        status, _ = await asyncio.shield(self._ended)
        return status

    def close(self) -> None:
        """Stop reading the output pipe (whoever still holds its other end gets EPIPE)."""
        self._pipe.close()


class Launcher:
    """The worker's side of the launcher. `start()` once and `watch_over()` in a task of its own;
    `spawn` jobs; `stop()` at the end (every job has ended by then).
    `harden`: the launcher gives up the right to gain privileges and its capabilities beyond the
    effective ones, for good (launcher.py): for a worker whose jobs run under slot uids."""

    def __init__(self, harden: bool = False) -> None:
        self.harden = harden
        self._proc: asyncio.subprocess.Process | None = None
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future[dict[str, Any]]] = {}  # request id -> its reply
        self._running: dict[int, asyncio.Future[tuple[int, list[int]]]] = {}  # pid -> (status, left)
        self._send_lock = asyncio.Lock()  # a request cut in datagrams goes out in one piece
        self._stopping = False
        self._ready: asyncio.Future[None] | None = None

    async def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-S",
                launcher.__file__,
                str(theirs.fileno()),
                "1" if self.harden else "0",
                stdin=asyncio.subprocess.DEVNULL,
                pass_fds=[theirs.fileno()],
                start_new_session=True,  # a Ctrl-C meant for the worker is the worker's
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        self._ready = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().add_reader(ours, self._readable)
        try:  # its first job would otherwise wait for its interpreter to start
            await asyncio.wait_for(asyncio.shield(self._ready), READY_SECONDS)
        except (TimeoutError, OSError) as exc:
            self._ready = None  # nobody will ask it again
            self._lost()
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            raise LauncherError(f"the job launcher did not start: {exc or 'no answer'}") from exc

    async def watch_over(self) -> None:
        """Until cancelled: when the launcher ends before `stop()`, give up on what it held (its
        jobs' groups are killed) and start a new one."""
        while (proc := self._proc) is not None:
            await proc.wait()
            if self._stopping or self._proc is not proc:
                return
            log.critical(
                "the job launcher (pid %d) ended with status %s; starting a new one",
                proc.pid,
                proc.returncode,
            )
            self._lost()
            await self.start()

    async def stop(self) -> None:
        """Close the socket (the launcher leaves at its end) and wait for it. Safe twice."""
        self._stopping = True
        proc, self._proc = self._proc, None
        self._lost()
        if proc is None:
            return
        try:
            await asyncio.wait_for(proc.wait(), STOP_SECONDS)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def spawn(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[str, str],
        identity: SlotIdentity | None = None,
        cgroup: Path | None = None,
    ) -> Child:
        """Start `argv` (no shell) in `cwd` with exactly `env` (PATH looked up in it), stdin from
        /dev/null, stdout and stderr into one pipe, in a session of its own, as `identity` when
        given (its directory is entered as that uid; when it ends, every process of the uid is
        killed before `wait()` returns, launcher.py), in `cgroup` when given (cgroups.py: all it
        starts is killed then in one write). Raises OSError when it cannot start (no such
        program, no such directory, or one the uid may not enter)."""
        request: dict[str, Any] = {"op": "spawn", "argv": list(argv), "env": dict(env), "cwd": str(cwd)}
        if identity is not None:
            request |= {"uid": identity.uid, "gid": identity.gid}
        if cgroup is not None:
            request["cgroup"] = str(cgroup)
        reply = await self._request(request)
        if "errno" in reply:
            code = reply["errno"]
            raise OSError(code, os.strerror(code) if code else "the launcher could not start it")
        pid, fd, ended = reply["pid"], reply["fd"], reply["ended"]
        output = None
        try:
            reader = asyncio.StreamReader()
            loop = asyncio.get_running_loop()
            output = os.fdopen(fd, "rb", buffering=0)  # a pipe's descriptor: nothing blocks
            pipe, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), output)
        except BaseException:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                if output is not None:
                    output.close()  # once wrapped, the file object's to close, and only its
                else:
                    os.close(fd)
            raise
        return Child(pid, reader, pipe, ended)

    async def sweep(self, identity: SlotIdentity) -> None:
        """Kill every process of `identity`'s uid and remove its temporary files (launcher.py)."""
        await self._request({"op": "sweep", "uid": identity.uid, "gid": identity.gid})

    async def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        if self._sock is None:
            raise OSError(errno.EPIPE, "the job launcher is not running")
        request_id = request["id"] = next(self._ids)
        reply = self._replies[request_id] = asyncio.get_running_loop().create_future()
        data = json.dumps(request).encode()
        chunks = [data[i : i + launcher.MAX_DATAGRAM] for i in range(0, len(data), launcher.MAX_DATAGRAM)]
        try:
            async with self._send_lock:
                for n, chunk in enumerate(chunks):
                    datagram = (b"+" if n < len(chunks) - 1 else b"") + chunk
                    try:  # a datagram goes whole or not at all; the socket's buffer seldom is full
                        self._sock.send(datagram)
                    except BlockingIOError:
                        await asyncio.get_running_loop().sock_sendall(self._sock, datagram)
            answer: dict[str, Any] = await reply
            return answer
        finally:
            self._replies.pop(request_id, None)

    def _readable(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._sock, 4096, 1)
            except BlockingIOError:
                return
            except OSError:
                data, fds = b"", []
            if not data:
                self._lost()
                return
            message = json.loads(data)
            if "ready" in message:
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(None)
                continue
            if "exited" in message:
                ended = self._running.pop(message["exited"], None)
                if ended is not None and not ended.done():
                    ended.set_result((message["status"], message["left"]))
                continue
            if "pid" in message:  # started: watched from here on, before any later message is read
                ended = self._running[message["pid"]] = asyncio.get_running_loop().create_future()
                message |= {"fd": fds[0], "ended": ended}
            reply = self._replies.get(message["id"])
            if reply is not None and not reply.done():
                reply.set_result(message)
            elif "pid" in message:  # its starter was cancelled while it started: nobody owns it
                with contextlib.suppress(OSError):
                    os.killpg(message["pid"], signal.SIGKILL)
                os.close(fds[0])

    def _lost(self) -> None:
        """The launcher is gone (or going): nothing it held will be answered. Running jobs are
        killed and taken as killed; waiting requests fail."""
        if self._sock is not None:
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(self._sock)
            self._sock.close()
            self._sock = None
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(OSError(errno.EPIPE, "the job launcher ended"))
        self._replies.clear()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(OSError(errno.EPIPE, "the job launcher ended"))
        for pid, ended in self._running.items():
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            if not ended.done():
                ended.set_result((-signal.SIGKILL, []))
        self._running.clear()
