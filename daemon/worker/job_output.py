"""A job's output on its way to the job's log stream in Redis.

Output (the runner merges stdout and stderr, in the order the job wrote them) is read from the
pipe by the event loop as it comes (a reader callback: no task, no stream object, so a job that
prints nothing costs nothing here) and sent through the queue's fenced `append_log` in chunks of
up to 64 KiB, at most ~100 ms after it was written while output flows, by a sender task that
exists only while there is output to send. The pipe is not read while a batch is on its way to
Redis, so a job that writes faster than Redis takes its output is slowed down (it blocks on a full
pipe) rather than growing the worker's memory. A refused append (StaleAttempt) means the attempt
is no longer this worker's: the owner is told, and nothing more is sent. While Redis is
unreachable, output waits in memory (the oldest dropped beyond MAX_BACKLOG, and the drop said in
the log) and is sent when Redis is back.

A tty job's output is its terminal's (terminal.py): the same reading, each piece also handed to
the terminal (`tee`), which may hold the reading back while its attached client's window is full.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

from daemon.aio import cancel_and_wait
from daemon.errors import StaleAttempt
from daemon.job import Lease
from daemon.worker.pool_link import UNREACHABLE, PoolLink

log = logging.getLogger(__name__)

CHUNK = 64 * 1024  # largest log entry: a stream entry stays small
CHUNKS_PER_CALL = 16
FLUSH_SECONDS = 0.1  # longest output waits before it is sent while it flows
RETRY_SECONDS = 1.0  # wait before sending again after Redis did not answer
MAX_BACKLOG = 4 * 2**20  # output kept in memory while Redis is unreachable
TAIL_BYTES = 16 * 1024
DRAIN_SECONDS = 5.0  # after the job's processes are gone, how long the rest may take to send


class JobOutput:
    """The output of one attempt: `read_from(fd)` once its process has started, `finish()` once
    its processes are gone; `note()` adds the pool's own lines at any time."""

    def __init__(self, queue: PoolLink, lease: Lease, on_refused: Callable[[str], None]) -> None:
        self.queue = queue
        self.lease = lease
        self.on_refused = on_refused
        self.closed = False  # no more sending: the attempt is not this worker's any more
        self._buf = bytearray()
        self._calls = 0  # append_log calls numbered (log.lua writes a call that comes twice once)
        self._unsent: tuple[int, list[bytes]] | None = None  # a numbered call not yet answered
        self._tail = bytearray()
        self._due = 0.0
        self._retry_at = 0.0
        self._dropped = 0
        self._down = False
        self.written = False  # anything (output or a note) went into the log from this attempt
        self._fd: int | None = None  # the pipe, while it is read
        self._tee: Callable[[bytes], None] | None = None  # a terminal's: each piece read, b"" at the end
        self._held = False  # a terminal's attached client has no room: nothing is read meanwhile
        self._reading = False
        self._eof: asyncio.Future[None] | None = None
        self._sender: asyncio.Task[None] | None = None
        self._more = asyncio.Event()  # a full chunk, or the end of the output: send without waiting

    def tail(self, lines: int) -> list[str]:
        """The last `lines` lines of the job's own output (not the pool's notes)."""
        return [line[:1000] for line in bytes(self._tail).decode(errors="replace").splitlines()[-lines:]]

    def note(self, text: str) -> None:
        """A line of the pool's own in the job's log, e.g. why it is being stopped."""
        self._append(f"[gpupool] {text}\n".encode())

    def read_from(self, fd: int, tee: Callable[[bytes], None] | None = None) -> None:
        """Read the job's output pipe `fd` (taken over: closed by `finish`) as output comes (each
        read follows the loop's word that the pipe is readable, so it never blocks). `tee` is
        given each piece read too, and b"" at its end (an error reading, such as a terminal's EIO
        once its last process has closed it, is the end)."""
        self._fd = fd
        self._tee = tee
        self._eof = asyncio.get_running_loop().create_future()
        self._resume()

    def hold(self, held: bool) -> None:
        """Stop reading (`held`), or read again: a terminal's attached client is slower than its job."""
        self._held = held
        if held:
            self._pause()
        else:
            self._resume()

    def _resume(self) -> None:
        if self._fd is not None and not self._reading and not self._held:
            asyncio.get_running_loop().add_reader(self._fd, self._readable)
            self._reading = True

    def _pause(self) -> None:
        if self._fd is not None and self._reading:
            asyncio.get_running_loop().remove_reader(self._fd)
            self._reading = False

    def _readable(self) -> None:
        assert self._fd is not None
        assert self._eof is not None
        try:
            data = os.read(self._fd, CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._pause()
            if not self._eof.done():
                self._eof.set_result(None)
                if self._tee is not None:
                    self._tee(b"")
            self._more.set()
            return
        if self._tee is not None:
            self._tee(data)
        self._append(data)
        self._tail += data
        del self._tail[:-TAIL_BYTES]

    def _append(self, data: bytes) -> None:
        self.written = True
        if not self._buf:
            self._due = time.monotonic() + FLUSH_SECONDS
        self._buf += data
        if len(self._buf) > MAX_BACKLOG:
            cut = len(self._buf) - MAX_BACKLOG
            del self._buf[:cut]
            self._dropped += cut
        if len(self._buf) >= CHUNK:
            self._more.set()
        if self._sender is None and not self.closed:
            self._sender = asyncio.get_running_loop().create_task(
                self._send(), name=f"output {self.lease.job_id}"
            )

    def _pending(self) -> bool:
        return bool(self._buf) or self._unsent is not None

    async def _send(self) -> None:
        """Send what comes, each batch when a chunk is full, the output has ended, or FLUSH_SECONDS
        after its first byte came (later while Redis does not answer); leave when nothing is left."""
        try:
            while self._pending() and not self.closed:
                now = time.monotonic()
                ended = self._eof is not None and self._eof.done()
                ready = (
                    self._retry_at if (ended or len(self._buf) >= CHUNK) else max(self._retry_at, self._due)
                )
                if ready > now:
                    self._more.clear()
                    with contextlib.suppress(TimeoutError):
                        # woken early by a full chunk or the end; never before a retry is due
                        async with asyncio.timeout(ready - now):
                            await self._more.wait()
                    if time.monotonic() < self._retry_at:
                        continue
                self._pause()  # nothing more is read while a batch is on its way
                try:
                    await self.flush()
                finally:
                    self._resume()
        finally:
            self._sender = None

    async def flush(self) -> None:
        """Send what is buffered (one script call per 16 chunks); keep it if Redis is down. A call
        that got no answer is sent again as it was, with its number, before anything newer."""
        if self.closed:
            self._buf.clear()
            self._unsent = None
            return
        if self._dropped:
            self._buf[:0] = (
                f"[gpupool] {self._dropped} bytes of output dropped: Redis was unreachable\n".encode()
            )
            self._dropped = 0
        try:
            while self._pending():
                if self._unsent is None:
                    batch = bytes(self._buf[: CHUNKS_PER_CALL * CHUNK])
                    del self._buf[: len(batch)]
                    self._calls += 1
                    self._unsent = (self._calls, [batch[i : i + CHUNK] for i in range(0, len(batch), CHUNK)])
                number, chunks = self._unsent
                await self.queue.append_log(self.lease, number, chunks)
                self._unsent = None
        except StaleAttempt:
            self.closed = True
            self._buf.clear()
            self._unsent = None
            self.on_refused("its log was refused: the attempt is no longer current")
        except UNREACHABLE as exc:
            if not self._down:
                log.warning(
                    "job %s: cannot send output (%s); keeping it until the pool answers",
                    self.lease.job_id,
                    exc,
                )
            self._down = True
            self._retry_at = time.monotonic() + RETRY_SECONDS
        else:
            self._down = False
            self._retry_at = 0.0

    async def finish(self) -> None:
        """Read the pipe to its end and send the rest, then close the pipe. Every writer is dead by
        now unless a process escaped the kill, and Redis may be unreachable: the wait is bounded."""
        job = self.lease.job_id
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_SECONDS
        try:
            if self._eof is not None and not self._eof.done():
                done, _ = await asyncio.wait({self._eof}, timeout=DRAIN_SECONDS)
                if not done:
                    log.warning("job %s: its output pipe is still open; not waiting for it", job)
            if (sender := self._sender) is not None:
                done, _ = await asyncio.wait({sender}, timeout=max(0.0, deadline - loop.time()))
                if not done:
                    await cancel_and_wait(sender)
                    if self._pending() and not self.closed:
                        log.warning(
                            "job %s: the last %d bytes of output could not be sent", job, self._unsent_bytes()
                        )
                elif not sender.cancelled() and (exc := sender.exception()) is not None:
                    log.error("job %s: sending its output failed", job, exc_info=exc)
            if self._pending() and not self._down:
                await self.flush()
        finally:
            self._pause()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _unsent_bytes(self) -> int:
        return len(self._buf) + (sum(map(len, self._unsent[1])) if self._unsent is not None else 0)
