"""The pool as the dashboard shows it, read at most once every few seconds for all its viewers.

Every open page refreshes itself every few seconds; a hundred of them must not read Redis a
hundred times. `Snapshots.get()` reads the pool (every retained job's line, the workers, each
queue's depth) when the last read is older than `max_age`, and every caller in between shares it;
callers that come while a read is under way wait for that one read. It also keeps each GPU's
recent readings (what its worker's heartbeats said), for the small charts.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from daemon.queue.job_queue import JobQueue
from daemon.queue.overview import JobRow, job_rows

HISTORY = 150  # readings kept per GPU: five minutes at one every two seconds


@dataclass(frozen=True, slots=True)
class Reading:
    at: float
    utilization: float | None  # 0-1
    memory_used: int | None
    memory_total: int | None


@dataclass
class Snapshot:
    at: float
    rows: list[JobRow]
    workers: list[dict[str, Any]]
    depths: dict[str, int]
    queues: list[str]
    history: dict[str, list[Reading]] = field(default_factory=dict)  # GPU uuid -> oldest first
    # Why queued jobs wait, as asked by the pages served from this snapshot: each job's reason is
    # read once for every viewer while the snapshot lasts.
    reasons: dict[str, str] = field(default_factory=dict)


class Snapshots:
    def __init__(
        self, queue: JobQueue, workers: Callable[[], Awaitable[list[dict[str, Any]]]], max_age: float = 2.0
    ) -> None:
        self._queue = queue
        self._workers = workers
        self.max_age = max_age
        self._last: Snapshot | None = None
        self._reading: asyncio.Future[Snapshot] | None = None
        self._history: defaultdict[str, deque[Reading]] = defaultdict(lambda: deque(maxlen=HISTORY))

    async def get(self) -> Snapshot:
        if self._last is not None and time.monotonic() - self._last.at < self.max_age:
            return self._last
        if self._reading is None or self._reading.done():  # one every waiter left is no news now
            self._reading = asyncio.ensure_future(self._read())
        reading = self._reading
        try:
            return await asyncio.shield(reading)  # a viewer that leaves does not cancel the others' read
        finally:
            if reading.done() and self._reading is reading:
                self._reading = None

    async def _read(self) -> Snapshot:
        queues = await self._queue.queues()
        workers = await self._workers()
        rows = await job_rows(self._queue.redis, queues)
        depths = await self._queue.depths(queues) if queues else {}
        seen = {str(g["uuid"]) for w in workers for g in w.get("gpus") or () if "uuid" in g}
        for gone in set(self._history) - seen:  # a worker's GPUs leave with it (pilots come and go)
            del self._history[gone]
        for worker in workers:
            for gpu in worker.get("gpus") or ():
                if "read_at" not in gpu:
                    continue
                history = self._history[str(gpu["uuid"])]
                if not history or history[-1].at != gpu["read_at"]:
                    history.append(
                        Reading(
                            gpu["read_at"],
                            gpu.get("utilization"),
                            gpu.get("memory_used"),
                            gpu.get("memory_total"),
                        )
                    )
        charts = {uuid: list(h) for uuid, h in self._history.items()}
        self._last = Snapshot(time.monotonic(), rows, workers, depths, queues, charts)
        return self._last
