"""Terminal-state notifications for `poolctl wait` and friends, from one blocking read.

One task per server reads the `events` streams of every queue with XREAD BLOCK (no polling) and
wakes the waiters of each job that ended. The pool's queue set is read again at most every
`refresh` seconds (and the read blocks for no longer), so an idle server costs Redis one SMEMBERS
and one XREAD a second whatever the number of queues. Its cursors start where the events stood
when the server started (`prime`, before any client can ask), so nothing that ends after that is
skipped. Events are a wake-up, not the truth: a waiter checks the job's state after registering,
and again every so often (handlers.py), so a lost or unseen event can delay an answer, never hang it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from redis.exceptions import RedisError

from daemon.job import JobState
from daemon.queue import keys
from daemon.queue.job_queue import JobQueue
from daemon.queue.reads import xread

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Terminal:
    """A job reached a terminal state; times are Redis server time in seconds (None: never ran)."""

    queue: str
    job_id: str
    state: JobState
    enqueued_at: float | None
    started_at: float | None
    ended_at: float | None


def _seconds(value: bytes | None) -> float | None:
    return int(value) / 1000 if value else None


class Changes:
    """What a waiter is told: the jobs it watches that have ended since it last took them."""

    def __init__(self) -> None:
        self._ended: set[str] = set()
        self._told = asyncio.Event()

    def note(self, job_id: str) -> None:
        self._ended.add(job_id)
        self._told.set()

    async def wait(self) -> None:
        """Until a job has ended since the last `take`."""
        await self._told.wait()

    def take(self) -> set[str]:
        """The jobs that ended since the last take (the empty set: none), forgotten here."""
        ended, self._ended = self._ended, set()
        self._told.clear()
        return ended


class JobEvents:
    def __init__(
        self, queue: JobQueue, refresh_seconds: float, on_terminal: Callable[[Terminal], None] | None = None
    ) -> None:
        self.queue = queue
        self.on_terminal = on_terminal
        self.refresh = refresh_seconds
        self._waiters: dict[str, set[Changes]] = {}
        self._cursors: dict[str, str] = {}
        self._refreshed = float("-inf")

    @contextlib.asynccontextmanager
    async def watching(self, job_ids: list[str]) -> AsyncIterator[Changes]:
        """Told of each of `job_ids` that reaches a terminal state, while the context lasts."""
        changes = Changes()
        for job_id in job_ids:
            self._waiters.setdefault(job_id, set()).add(changes)
        try:
            yield changes
        finally:
            for job_id in job_ids:
                waiters = self._waiters.get(job_id)
                if waiters is not None:
                    waiters.discard(changes)
                    if not waiters:
                        del self._waiters[job_id]

    async def prime(self) -> None:
        """Start every known queue's cursor at its newest event: history is not news."""
        for q in await self.queue.queues():
            self._cursors[q] = await self.queue.last_event_id(q)
        self._refreshed = asyncio.get_running_loop().time()

    async def run(self) -> None:
        """Read terminal events until cancelled."""
        while True:
            try:
                await self._pass()
            except RedisError as exc:
                log.warning("reading job events failed (%s); retrying", exc)
                await asyncio.sleep(1)

    async def _pass(self) -> None:
        loop = asyncio.get_running_loop()
        if loop.time() - self._refreshed >= self.refresh:
            for q in await self.queue.queues():
                # a queue that appears later: from its first event, which may predate our noticing it
                self._cursors.setdefault(q, "0-0")
            self._refreshed = loop.time()
        if not self._cursors:
            await asyncio.sleep(self.refresh)
            return
        queue_of_stream = {keys.events(q): q for q in self._cursors}
        streams = {stream: self._cursors[q] for stream, q in queue_of_stream.items()}
        for stream, entries in await xread(self.queue.redis, streams, block=self.refresh):
            q = queue_of_stream[stream]
            for entry_id, fields in entries:
                self._cursors[q] = entry_id.decode()
                job_id = fields[b"job"].decode()
                for changes in self._waiters.get(job_id, ()):
                    changes.note(job_id)
                if self.on_terminal is not None:
                    self.on_terminal(
                        Terminal(
                            q,
                            job_id,
                            JobState(fields[b"state"].decode()),
                            _seconds(fields.get(b"enqueued_at")),
                            _seconds(fields.get(b"started_at")),
                            _seconds(fields.get(b"ended_at")),
                        )
                    )
