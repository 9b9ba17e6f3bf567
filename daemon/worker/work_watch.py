"""How an idle worker waits for work, and how a job enqueued on an idle pool reaches its slot.

A worker whose last claim found nothing waits for a new entry in its queues' streams: one
blocking XREAD (JobQueue.wait_for_work). That read is kept from one wait to the next, and
cancelled only when the worker stops: a wait ended by something else (a slot freed, a drain) leaves
it in flight for the next, since cancelling it makes redis-py drop its connection, and a worker
then made a new one (three round trips) for every job. A read may so answer an entry that a
claim made since has seen (took, or passed over): that is no news (JobQueue.news), and a new read,
after what the claim saw, goes on waiting. A job taken by the standing claim below wakes its
worker's read too (the read was sent before it): no claim follows either.

A worker without GPUs also leaves its next claim standing with its JobQueue while it waits
(claims.Standing): the first enqueue to one of its queues through that JobQueue sends the claim
right after its own call, in the same round trip, and the job starts with no claim round trip
after its enqueue. In a single-machine pool the server enqueues through the JobQueue its slots
claim through, so an idle pool starts a job one round trip to Redis after the client's request
reached the server. What the claim takes is what any claim takes (claim.lua: the head of the
queue, FIFO), and it stays unanswered until its reply is read here, as any claim does, so a
worker stopped in between settles it (JobQueue.settle_claims). It goes only while the worker may
claim (its heartbeats succeed, no pause after a Redis restart: claim_gate.py), and a pilot's
lifetime in it is counted down while it stands. A GPU worker leaves none: its claim carries NVML's
readings of free memory, which would age while it stands.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from daemon.aio import cancel_and_wait
from daemon.job import Lease
from daemon.queue.job_queue import JobQueue

WAIT_BLOCK = 5.0  # longest blocking read for work before claiming again (a safety net only)


class WorkWatch:
    """The blocking read, and the standing claim, of worker `worker` on `queues`. `close()` at
    the end."""

    def __init__(self, queue: JobQueue, worker: str, queues: Sequence[str]) -> None:
        self.queue = queue
        self.worker = worker
        self.queues = list(queues)
        self._read: asyncio.Future[list[tuple[str, str]]] | None = None  # in flight from one wait to the next

    async def wait(self, wake: asyncio.Event, claim: dict[str, Any] | None) -> list[Lease] | None:
        """Until one of the queues gets an entry no claim has seen, `wake` is set, or the claim left standing
        meanwhile was sent. `claim`: that claim, as claim_many's keyword arguments and `count`
        (None: none stands). Returns what the claim got once it was sent (maybe nothing), else None."""
        standing = self.queue.stand(self.worker, self.queues, **claim) if claim is not None else None
        woken = asyncio.ensure_future(wake.wait())
        taken = asyncio.ensure_future(standing.taken.wait()) if standing is not None else woken
        got = None
        try:
            while True:
                read = self._reading()
                waits: set[asyncio.Future[Any]] = {read, woken, taken}
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if woken.done() or taken.done() or self._reading() is read:
                    break  # else it answered what a claim had seen meanwhile: a new read waits
            if standing is not None and not self.queue.withdraw(standing):  # sent: its jobs
                got = await self.queue.standing_claimed(standing)
        finally:
            if standing is not None:
                self.queue.withdraw(standing)  # never left standing for a worker not waiting
            # These waits hold nothing: cancelled, they end in the next turn by themselves.
            woken.cancel()
            taken.cancel()
        if read.done():  # the next wait sends a new one, with the cursors of the claims since
            self._read = None
            failed = None if read.cancelled() else read.exception()
            if failed is not None and got is None:
                raise failed
        return got

    def _reading(self) -> asyncio.Future[list[tuple[str, str]]]:
        """The read in flight, or its answer when that is news (or its error); else a new read. A
        read's answer is no news when every entry it names was seen by a claim since: one sent
        in a job's enqueue round trip (the standing claim) took the entry this read was woken by."""
        read = self._read
        if read is not None and read.done() and not read.cancelled() and read.exception() is None:
            entries = read.result()
            if entries and not self.queue.news(entries):
                read = None
        if read is None:
            read = self._read = asyncio.ensure_future(self.queue.wait_for_work(self.queues, WAIT_BLOCK))
        return read

    async def close(self) -> None:
        """Cancel the read in flight (which costs its connection: the worker is stopping)."""
        if self._read is not None:
            read, self._read = self._read, None
            await cancel_and_wait(read)
            if not read.cancelled():
                read.exception()  # retrieved: it has ended either way
