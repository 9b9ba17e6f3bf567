"""TCP connections to a port inside a running job (`poolctl forward`): the worker's end of a
channel of kind "forward".

Each channel is one connection, to 127.0.0.1:PORT as the job sees it: the worker's own loopback
when the job shares the worker's network namespace, the job's when it has one of its own
(`job_network = "private"`). The socket is made by a thread of its own that joins the job's
namespace (setns(2) on the job's first process's, held open from the first forward into it while
that process was unreaped: spawn.Child.namespace), becomes the job's uid (so the host's rules by
uid apply to it as to the job's own sockets), connects, and ends: a socket keeps the namespace
and owner it was made with, and the thread, no longer the worker's, serves nothing else (never a
pool's thread, which would go on to run the worker's own work so).

Bytes go both ways through the channel's Streams, held to its windows as an exec's output and
input are (execs.py, whose relaying this reuses): what the job's end of the connection sends
comes back as output; the client's input is written to it, and the client's end of input
half-closes it (shutdown SHUT_WR). The job's end half-closing it is relayed too (`e`: the client
half-closes its side), and the input goes on. It ends once both directions have ended (after
all the job's end sent is relayed), or the job's end takes no more input, when the client
cancels or goes away, or when the job ends. Every connection is written
in the job's log as a line of the pool's own, and in the worker's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import platform
import socket
import threading

from daemon.queue import channels
from daemon.queue.connection import AnyRedis
from daemon.worker.execs import ExecCommand
from daemon.worker.identity import SlotIdentity
from daemon.worker.runner import JobRun
from daemon.worker.spawn import Spawner

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000  # <sched.h>: setns(2)'s nstype for a network namespace
CONNECT_SECONDS = 10.0  # a connection to a loopback port is answered at once, unless its backlog is full


class Forward(ExecCommand):
    """One connection to port `port` inside a job, relayed until either end closes it."""

    def __init__(self, redis: AnyRedis, job_id: str, session: str, run: JobRun, *, port: int) -> None:
        super().__init__(redis, job_id, session, run, argv=[], stdin=True)
        self.port = port

    async def run(self, spawner: Spawner, user: str) -> None:
        """Relay the connection until it ends, then its end (`spawner`: none is started)."""
        del spawner
        code, why = b"", "the worker failed to relay it"
        try:
            code, why = await self._connected(user)
            log.info("forward by %s to port %d in job %s ended: %s", user, self.port, self.job_id, why)
        finally:  # always: its server waits for this entry until the job ends
            await self.end(code, why)

    async def _connected(self, user: str) -> tuple[bytes, str]:
        """The connection relayed until it ends: its exit code (b"0" closed, b"" never open) and why."""
        job = self.run_.first_process
        assert job is not None
        try:
            sock = await connect_in_job(job.namespace("net"), self.port, self.run_.identity)
        except OSError as exc:
            why = f"cannot connect to port {self.port} inside the job: {exc.strerror or exc}"
            log.info("forward by %s in job %s: %s", user, self.job_id, why)
            return b"", why
        self.run_.output.note(f"forward by {user} to port {self.port}")
        log.info("forward by %s to port %d in job %s", user, self.port, self.job_id)
        reader, writer = await asyncio.open_connection(sock=sock, limit=channels.READ_CHUNK)
        pump = asyncio.ensure_future(self._relay(reader, b"o"))
        inbound = asyncio.ensure_future(self._inbound())
        feed = asyncio.ensure_future(self._write(writer))
        job_ended = asyncio.ensure_future(job.wait())
        helpers = (pump, inbound, feed, job_ended)
        try:
            await asyncio.wait({pump, inbound, job_ended}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done() and pump.exception() is None and not feed.done():
                # The job's end has shut its side (its output has ended): the client's end is told
                # (`e`), and its input goes on until it ends too, or the job's end takes no more.
                self.writes.append(self.out, {b"e": b"1"})
                await asyncio.wait({feed, inbound, job_ended}, return_when=asyncio.FIRST_COMPLETED)
            if job_ended.done():
                return b"0", "the job ended"
            if inbound.done():
                return b"0", inbound.result()
            failed = pump.exception()
            return b"0", f"closed inside the job ({failed})" if failed else "closed inside the job"
        finally:
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            writer.close()

    async def _write(self, writer: asyncio.StreamWriter) -> None:
        """Write the client's input to the connection, crediting each piece once written; the
        input's end half-closes it. Returns then, or once the job's end takes no more (it has
        closed the connection: nothing more can reach it)."""
        while (data := await self._input.get()) is not None:
            try:
                writer.write(data)
                await writer.drain()
            except ConnectionError:
                return
            self.writes.append(self.out, {b"c": str(len(data)).encode()})
        with contextlib.suppress(OSError):
            writer.write_eof()


async def connect_in_job(theirs: int, port: int, identity: SlotIdentity | None = None) -> socket.socket:
    """A connected, non-blocking socket to 127.0.0.1:`port` in network namespace `theirs` (a
    descriptor, closed here: the job's, Child.namespace), made as `identity`'s uid when given
    (the job's: the host's rules by uid apply to it as to the job's own sockets)."""
    loop = asyncio.get_running_loop()
    try:
        own = os.fstat(theirs).st_ino == os.stat("/proc/self/ns/net").st_ino
        if own and (identity is None or _SET_IDS is None):  # the worker's namespace, as itself
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), CONNECT_SECONDS)
            except BaseException:
                sock.close()
                raise
            return sock
        made: asyncio.Future[socket.socket] = loop.create_future()
        ids = (identity.uid, identity.gid) if identity is not None else None
        thread = threading.Thread(target=_connect_in, args=(theirs, port, ids, loop, made), daemon=True)
        thread.start()
        theirs = -1  # the thread's to close
        return await made
    finally:
        if theirs >= 0:
            os.close(theirs)


def _connect_in(
    netns: int,
    port: int,
    ids: tuple[int, int] | None,
    loop: asyncio.AbstractEventLoop,
    made: asyncio.Future[socket.socket],
) -> None:
    """A thread's whole life: join namespace `netns` (closed here), become uid and gid `ids` (this
    thread only: raw system calls, which glibc's wrappers would make every thread's), connect to
    `port` there, and hand the socket (or the OSError) to `made` on `loop`. The thread ends so."""
    result: socket.socket | OSError
    try:
        try:
            if _setns(netns, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"cannot enter the job's network namespace: {os.strerror(err)}")
        finally:
            os.close(netns)
        if ids is not None and _SET_IDS is not None:
            setgroups, setresgid, setresuid = _SET_IDS
            uid, gid = ids
            for call, args in ((setgroups, (0, None)), (setresgid, (gid,) * 3), (setresuid, (uid,) * 3)):
                if _libc.syscall(call, *args) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"cannot become the job's uid: {os.strerror(err)}")
        result = socket.create_connection(("127.0.0.1", port), timeout=CONNECT_SECONDS)
        result.setblocking(False)
    except OSError as exc:
        result = exc
    except Exception as exc:  # noqa: BLE001 - any failure must reach its waiter, which else waits for good
        result = OSError(f"cannot connect: {exc}")
    with contextlib.suppress(RuntimeError):  # the loop has closed: the worker is gone
        loop.call_soon_threadsafe(_hand_over, made, result)


def _hand_over(made: asyncio.Future[socket.socket], result: socket.socket | OSError) -> None:
    if made.done():  # its waiter was cancelled: nobody takes the socket
        if isinstance(result, socket.socket):
            result.close()
    elif isinstance(result, OSError):
        made.set_exception(result)
    else:
        made.set_result(result)


_libc = ctypes.CDLL(None, use_errno=True)
_setns = _libc.setns
_setns.argtypes = (ctypes.c_int, ctypes.c_int)
_setns.restype = ctypes.c_int
# setgroups, setresgid, setresuid: the raw system calls' numbers (None: another machine, where the
# socket is made as the worker's own uid)
_SET_IDS: tuple[int, int, int] | None = {"x86_64": (116, 119, 117), "aarch64": (159, 149, 147)}.get(
    platform.machine()
)
"".encode("idna")  # loaded now: socket.connect encodes its host so, in a thread that, as a job's
# uid, may no longer read Python's own files
