"""A tty job's terminal (`poolctl shell`): the worker's end of the PTY its first process runs on.

The job's first process gets the PTY's slave end as its stdin, stdout and stderr, and as its
session's controlling terminal (spawn.py, _spawn.c's TIOCSCTTY): the line discipline then turns
a client's Ctrl-C and Ctrl-Z into SIGINT and SIGTSTP for the foreground process group, and a
window change into SIGWINCH, as on any terminal; nothing of ours interprets the bytes.

The worker keeps the master. It is read always, as a job's output pipe is (job_output.py, which
also gives each piece to `took` here): what the shell writes goes into the job's log (`poolctl
logs` shows the session), to the attached client if there is one, and into the last TAIL_BYTES
kept for the next attach to replay. A shell never blocks on a viewer that has gone: with none
attached nothing holds the reading back; while one is, its window does (as ssh's does), so a
slow client slows the shell rather than growing the worker. The master's EIO once the slave's
last holder has closed it is the end of the output, not an error.

One client is attached at a time (attach.py, a channel of kind "attach"): a new one takes over,
and the one before is told why it was detached. Each piece of a client's input is written into
the master as it is; the job ends once no client has typed into it, attached to it or resized
it for its idle limit (`idle`), attached or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import struct
import termios
from collections.abc import Callable
from typing import Protocol

TAIL_BYTES = 64 * 1024  # what a reattach replays of the session
ROWS, COLS = 24, 80  # a terminal's size until a client says its own


class Viewer(Protocol):
    """The attached client's end (attach.py)."""

    def show(self, data: bytes) -> None:
        """Output of the terminal, to relay; b"": its end."""

    def taken_over(self) -> None:
        """Another client has attached: this one is detached."""


class Terminal:
    """The master end of a tty job's PTY: `slave` for its first process (the spawner's; close it
    once spawned), `took` for each piece of its output, `attach` and `write` for its client."""

    def __init__(self, idle_limit: float, idle: Callable[[float], None], owner: int | None = None) -> None:
        """`idle(limit)` is called once no input has come for `idle_limit` seconds. `owner`: the
        job's uid, which is given the terminal (as a login's is: a program that opens it by its
        name, as `tty` prints it, may), its mode left as the kernel made it (no other uid may)."""
        self.master, self.slave = os.openpty()
        if owner is not None:
            os.fchown(self.slave, owner, -1)
        os.set_blocking(self.master, False)  # a write into a full terminal waits in the loop
        self.resize(ROWS, COLS)
        self.idle_limit = idle_limit
        self._idle = idle
        self._tail = bytearray()
        self.viewer: Viewer | None = None
        self.ended = False  # its output has ended (every holder of the slave has closed it)
        self.hold: Callable[[bool], None] = lambda held: None  # job_output's reading, held or not
        self._held = False
        loop = asyncio.get_running_loop()
        self._last_input = loop.time()
        self._idle_timer = loop.call_later(idle_limit, self._check_idle)

    def output_fd(self) -> int:
        """A descriptor of the master for the job's output to read (its own: it closes it)."""
        return os.dup(self.master)

    def took(self, data: bytes) -> None:
        """A piece of the terminal's output (b"": its end), read by the job's output."""
        if not data:
            self.ended = True
            self._idle_timer.cancel()
        self._tail += data
        del self._tail[:-TAIL_BYTES]
        if self.viewer is not None:
            self.viewer.show(data)

    def attach(self, viewer: Viewer) -> bytes:
        """`viewer` is the attached client now (the one before, if any, is detached); returns
        the kept tail of the session for it to replay."""
        if self.viewer is not None:
            self.viewer.taken_over()
        self.viewer = viewer
        self._active()
        return bytes(self._tail)

    def detach(self, viewer: Viewer) -> None:
        """`viewer` has gone: nothing holds the reading back any more."""
        if self.viewer is viewer:
            self.viewer = None
            self.hold_output(False)

    def hold_output(self, held: bool) -> None:
        """Hold the reading of its output back (the viewer's window is full), or let it go on."""
        if held != self._held:
            self._held = held
            self.hold(held)

    async def write(self, data: bytes) -> None:
        """The client's input into the terminal, as it is; it counts as input for the idle limit.
        Waits while the terminal takes no more (its program reads nothing)."""
        self._active()
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.master, view) :]
            except BlockingIOError:
                await self._writable()
            except OSError:  # its program has gone (EIO): the input has nowhere to go
                return

    async def _writable(self) -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_writer(self.master, _settle, ready)
        try:
            await ready
        finally:
            loop.remove_writer(self.master)

    def resize(self, rows: int, cols: int) -> None:
        """The window is `rows` x `cols` now: the kernel tells the foreground group (SIGWINCH).
        A client's resize counts as input for the idle limit, as its attach does."""
        self._active()
        with contextlib.suppress(OSError):
            fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def _active(self) -> None:
        """Its user is at it (typing, attaching, resizing): the idle limit counts from now."""
        self._last_input = asyncio.get_running_loop().time()

    def _check_idle(self) -> None:
        loop = asyncio.get_running_loop()
        quiet = loop.time() - self._last_input
        if quiet >= self.idle_limit:
            self._idle(self.idle_limit)
        else:
            self._idle_timer = loop.call_later(self.idle_limit - quiet, self._check_idle)

    def close(self) -> None:
        """The job has ended: its master goes (a viewer still attached has been told the end)."""
        self._idle_timer.cancel()
        for fd in (self.master, self.slave):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.master = self.slave = -1

    def close_slave(self) -> None:
        """The job's first process has its own: the worker's copy goes (else its EIO never comes)."""
        if self.slave >= 0:
            os.close(self.slave)
            self.slave = -1


def _settle(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)
