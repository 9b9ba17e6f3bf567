"""A job's output on its way to the job's log stream in Redis.

Output (the runner merges stdout and stderr, in the order the job wrote them) is read as it comes,
without blocking the event loop, and sent through the queue's fenced `append_log` in chunks of up
to 64 KiB, at most ~100 ms after it was written while output flows. The pipe is not read while a
batch is being sent, so a job that writes faster than Redis takes its output is slowed down (it
blocks on a full pipe) rather than growing the worker's memory. A refused append (StaleAttempt)
means the attempt is no longer this worker's: the owner is told, and nothing more is sent. While
Redis is unreachable, output waits in memory (the oldest dropped beyond MAX_BACKLOG, and the
drop said in the log) and is sent when Redis is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from daemon.aio import cancel_and_wait
from daemon.errors import StaleAttempt
from daemon.job import Lease
from daemon.queue.job_queue import JobQueue

log = logging.getLogger(__name__)

CHUNK = 64 * 1024  # largest log entry: a stream entry stays small
CHUNKS_PER_CALL = 16
FLUSH_SECONDS = 0.1  # longest output waits before it is sent while it flows
RETRY_SECONDS = 1.0  # wait before sending again after Redis did not answer
MAX_BACKLOG = 4 * 2**20  # output kept in memory while Redis is unreachable
TAIL_BYTES = 16 * 1024
DRAIN_SECONDS = 5.0  # after the job's processes are gone, how long the rest may take to send


class JobOutput:
    """The output of one attempt. `pump(reader)` in a task, `finish(task)` after the processes."""

    def __init__(self, queue: JobQueue, lease: Lease, on_refused: Callable[[str], None]) -> None:
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

    def tail(self, lines: int) -> list[str]:
        """The last `lines` lines of the job's own output (not the pool's notes)."""
        return [line[:1000] for line in bytes(self._tail).decode(errors="replace").splitlines()[-lines:]]

    def note(self, text: str) -> None:
        """A line of the pool's own in the job's log, e.g. why it is being stopped."""
        self._append(f"[gpupool] {text}\n".encode())

    def _append(self, data: bytes) -> None:
        self.written = True
        if not self._buf:
            self._due = time.monotonic() + FLUSH_SECONDS
        self._buf += data
        if len(self._buf) > MAX_BACKLOG:
            cut = len(self._buf) - MAX_BACKLOG
            del self._buf[:cut]
            self._dropped += cut

    def _pending(self) -> bool:
        return bool(self._buf) or self._unsent is not None

    async def pump(self, reader: asyncio.StreamReader) -> None:
        """Read the job's output until end of file, sending it as it comes."""
        eof = False
        while not eof or self._pending():
            now = time.monotonic()
            wait: float | None = None
            if self._pending():
                ready = max(self._retry_at, now if len(self._buf) >= CHUNK else self._due)
                if eof or ready <= now:
                    await asyncio.sleep(max(0.0, self._retry_at - now))
                    await self.flush()
                    continue
                wait = ready - now
            try:
                async with asyncio.timeout(wait):
                    data = await reader.read(CHUNK)
            except TimeoutError:
                continue  # time to send what is buffered
            if not data:
                eof = True
                continue
            self._append(data)
            self._tail += data
            del self._tail[:-TAIL_BYTES]

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
        except RedisError as exc:
            if not self._down:
                log.warning(
                    "job %s: cannot send output (%s); keeping it until Redis answers", self.lease.job_id, exc
                )
            self._down = True
            self._retry_at = time.monotonic() + RETRY_SECONDS
        else:
            self._down = False

    async def finish(self, pump: asyncio.Task[None]) -> None:
        """Let the pump read to end of file and send the rest. Every writer is dead by now unless a
        process escaped the kill, and Redis may be unreachable: the wait is bounded."""
        done, _ = await asyncio.wait({pump}, timeout=DRAIN_SECONDS)
        job = self.lease.job_id
        if not done:
            await cancel_and_wait(pump)
            if self._pending() and not self.closed:
                log.warning(
                    "job %s: the last %d bytes of output could not be sent", job, self._unsent_bytes()
                )
            elif not self._pending():
                log.warning("job %s: its output pipe is still open; not waiting for it", job)
        elif (exc := pump.exception()) is not None:
            log.error("job %s: reading its output failed", job, exc_info=exc)
        if self._pending() and not self._down:
            await self.flush()

    def _unsent_bytes(self) -> int:
        return len(self._buf) + (sum(map(len, self._unsent[1])) if self._unsent is not None else 0)
