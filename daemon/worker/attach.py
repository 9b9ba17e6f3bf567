"""A client attached to a tty job's terminal (`poolctl shell`, `poolctl attach`): the worker's end
of a channel of kind "attach".

The terminal (terminal.py) is the job's: this is one client's view of it, relayed through the
channel's Streams within their windows as an exec's output and input are (execs.py, whose
relaying this reuses). On attaching, the client gets the kept tail of the session, then the
terminal's output as it comes; its input goes into the terminal as it is, and its window's size
(`w`) becomes the terminal's. Attaching is written in the job's log, as an exec is.

It detaches, leaving the shell as it is, when the server asks (`k`: the client detached, or went
away), when its server has gone, or when another client attaches (it is told so). When the job's
first process ends, the rest of the output is relayed, then the job's exit code ends the channel,
with `exited` as its reason when the shell ended by itself, else what stopped the job; when its
program never started (an attach served between its spawn and its reap), no code, and the reason
says it is not running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from daemon.queue import channels
from daemon.queue.connection import AnyRedis
from daemon.worker.execs import DRAIN_SECONDS, NOT_RUNNING, ExecCommand
from daemon.worker.run_types import describe_exit
from daemon.worker.runner import JobRun
from daemon.worker.spawn import Spawner
from daemon.worker.terminal import Terminal

log = logging.getLogger(__name__)

TAKEN_OVER = "detached: attached elsewhere"
EXITED = "exited"  # ChannelClosed's reason once the shell has exited (as an exec's)


class Attach(ExecCommand):
    """One client's view of a job's terminal, relayed until it detaches or the job ends."""

    def __init__(
        self, redis: AnyRedis, job_id: str, session: str, run: JobRun, *, size: tuple[int, int]
    ) -> None:
        super().__init__(redis, job_id, session, run, argv=[], stdin=True)
        self.size = size  # (0, 0): the client did not say
        self._backlog = bytearray()  # the terminal's output not yet relayed: about a window at most
        self._output_changed = asyncio.Event()
        self._ended = False  # the terminal's output has ended
        self._taken_over = asyncio.Event()
        self._terminal: Terminal | None = None

    # -- terminal.Viewer --------------------------------------------------------------------------

    def show(self, data: bytes) -> None:
        if not data:
            self._ended = True
        self._backlog += data
        self._output_changed.set()
        if self._terminal is not None and len(self._backlog) >= channels.OUT_WINDOW:
            self._terminal.hold_output(True)  # the client's window holds the shell back, as ssh's does

    def taken_over(self) -> None:
        self._taken_over.set()

    # -- the channel ------------------------------------------------------------------------------

    async def run(self, spawner: Spawner, user: str) -> None:
        """Relay until the client detaches or the job ends, then the channel's end: always (its
        server waits for that entry until the job ends). `spawner`: none is started."""
        del spawner
        code, why = b"", "the worker failed to relay it"
        try:
            code, why = await self._attached(user)
            log.info("attach by %s to job %s ended: %s", user, self.job_id, why)
        finally:
            await self.end(code, why)  # after all output and credit put before it

    async def _attached(self, user: str) -> tuple[bytes, str]:
        run, job = self.run_, self.run_.first_process
        terminal = run.terminal
        if terminal is None or job is None:
            return b"", f"job {self.job_id} has no terminal: run a command in it with `poolctl exec`"
        self._terminal = terminal
        self._backlog += terminal.attach(self)  # the session's kept tail, replayed first
        self._ended = terminal.ended
        run.output.note(f"attach by {user}")
        log.info("attach by %s to job %s", user, self.job_id)
        if self.size != (0, 0):
            terminal.resize(*self.size)
        helpers = [
            asyncio.ensure_future(self._send_output()),
            asyncio.ensure_future(self._type_input(terminal)),
        ]
        inbound = asyncio.ensure_future(self._inbound())
        job_ended = asyncio.ensure_future(job.wait())
        taken_over = asyncio.ensure_future(self._taken_over.wait())
        watched = {inbound, job_ended, taken_over}
        try:
            await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            if taken_over.done():
                return b"", TAKEN_OVER
            if inbound.done():
                return b"", f"detached ({inbound.result()})"
            await self._drain_output(helpers[0], inbound)
            if job.start_error is not None:  # no shell was reached: the client asks the job why
                return b"", f"{NOT_RUNNING}: its program did not start ({job.start_error.strerror})"
            code, _ = describe_exit(job_ended.result())
            # What ended it: the shell itself, or what stopped its job (a cancel, its idle limit,
            # its time limit, its worker's drain), which the client then says.
            return str(code).encode(), EXITED if run.ending is None else run.stopped_why
        finally:
            terminal.detach(self)
            for task in (*helpers, *watched):
                task.cancel()
            await asyncio.gather(*helpers, *watched, return_exceptions=True)

    async def _drain_output(self, sender: asyncio.Future[None], inbound: asyncio.Future[Any]) -> None:
        """Once the shell has exited: relay the rest of its output (its end comes once every
        holder of the terminal has gone, DRAIN_SECONDS at most), however slowly the client reads,
        until the server asks otherwise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_SECONDS
        while not self._ended and loop.time() < deadline and not inbound.done():
            self._output_changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(deadline - loop.time()):
                    await self._output_changed.wait()
        self._ended = True
        self._output_changed.set()
        waited: set[asyncio.Future[Any]] = {sender, inbound}
        await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)

    async def _send_output(self) -> None:
        """The backlog to the client within the window; returns once it is sent and the output
        has ended."""
        while True:
            while not self._backlog:
                if self._ended:
                    return
                self._output_changed.clear()
                await self._output_changed.wait()
            while self._unread_bytes >= channels.OUT_WINDOW or len(self._unread) >= channels.OUT_ENTRIES:
                self._taken.clear()
                await self._taken.wait()
            size = min(len(self._backlog), channels.READ_CHUNK, channels.OUT_WINDOW - self._unread_bytes)
            data = bytes(self._backlog[:size])
            del self._backlog[:size]
            if self._terminal is not None and len(self._backlog) < channels.OUT_WINDOW:
                self._terminal.hold_output(False)
            self._unread.append(size)
            self._unread_bytes += size
            self.writes.append(self.out, {b"o": data})

    async def _type_input(self, terminal: Terminal) -> None:
        """The client's input into the terminal as it is (Ctrl-C is a byte its line discipline
        turns into SIGINT), each piece credited once written. Its end ends nothing: a terminal's
        end of input is a Ctrl-D typed."""
        while True:
            data = await self._input.get()
            if data is None:
                continue
            await terminal.write(data)
            self.writes.append(self.out, {b"c": str(len(data)).encode()})

    def _resize(self, rows: int, cols: int) -> None:
        if self._terminal is not None:
            self._terminal.resize(rows, cols)
