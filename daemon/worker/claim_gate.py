"""When a worker may claim: while its heartbeat succeeds, and not in the pause after Redis restarts.

A worker claims nothing while its heartbeats fail (what it claimed might not be renewed), and
nothing for a while after Redis restarts or fails over (queue/connection.py RunIdWatch): such a Redis may
have forgotten claims of other workers, whose attempts then run on until those workers
re-validate their leases. Each does at once when it sees the restart (the gate pokes its
heartbeat), and at the latest with its next heartbeat, which may take its whole timeout to get
through (reconnecting, with back-off, to a Redis that is still loading): the pause is a heartbeat
interval plus a beat's timeout plus the margin, counted from when this worker saw the restart,
which is never before the restart itself. A worker that starts on a Redis younger than that pause,
holding leases, waits out the rest of it too. Young means: the pool has known this redis-server
for less than that (JobQueue.primary_age, recorded in Redis by the first worker to see it): a
replica promoted in a failover has run for long, but has been the pool's Redis only since then.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

from redis.exceptions import RedisError

from daemon.aio import woken_or
from daemon.queue.job_queue import JobQueue
from daemon.worker.attempt import boottime
from daemon.worker.heartbeat import Heartbeat


class ClaimGate:
    def __init__(self, queue: JobQueue, heartbeat: Heartbeat, queues: Sequence[str]) -> None:
        self.queue = queue
        self.heartbeat = heartbeat
        self.queues = list(queues)
        self.paused_until = 0.0  # boottime()

    @property
    def pause(self) -> float:
        return self.heartbeat.interval + self.heartbeat.timeout + self.heartbeat.margin

    def restarted(self) -> None:
        """Redis restarted: re-validate every lease now, and claim nothing for a while."""
        self.paused_until = max(self.paused_until, boottime() + self.pause)
        self.heartbeat.poke()

    async def watch(self) -> None:
        """Until cancelled: `restarted()` whenever the queue's RunIdWatch sees another Redis."""
        watch = self.queue.watch
        assert watch is not None
        while True:
            await watch.changed.wait()
            watch.changed.clear()
            self.restarted()
            with contextlib.suppress(RedisError):  # recorded for the workers that start after it
                await self.queue.primary_age(self.queues)

    async def at_start(self) -> None:
        """Pause as after a restart if Redis is younger than the pause and holds leases."""
        try:
            age = await self.queue.primary_age(self.queues)
        except RedisError:  # Redis went away since registering: taken as new, the safe side
            age = 0.0
        young = self.pause - age
        if young > 0 and await self.queue.leases_held(self.queues):
            self.paused_until = boottime() + young

    def open_now(self) -> bool:
        """Whether a claim may go now: the heartbeat succeeds and no pause holds claims."""
        return self.heartbeat.healthy.is_set() and boottime() >= self.paused_until

    async def opened(self, wake: asyncio.Event, stopping: Callable[[], bool]) -> None:
        """Return once claims may go (or `stopping()`); `wake` cuts a wait short to look again."""
        while not stopping():
            if not self.heartbeat.healthy.is_set():
                waits = {asyncio.ensure_future(e.wait()) for e in (self.heartbeat.healthy, wake)}
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
            else:
                pause = self.paused_until - boottime()
                if pause <= 0:
                    return
                await woken_or(wake, pause)
            wake.clear()
