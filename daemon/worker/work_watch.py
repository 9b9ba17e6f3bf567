"""How an idle worker waits for work, and how a job enqueued on an idle pool reaches its slot.

A worker whose last claim found nothing waits for a new entry in its queues' streams: one
blocking XREAD (JobQueue.read_for_work). That read is kept from one wait to the next, until it
has answered, and read only while the worker waits (work_read.py): a wait ended by something else
(a slot freed, a drain) leaves it sent, its reply, if one comes meanwhile, left in its socket for
the next wait. (Cancelling redis-py's read of it dropped its connection, and an idle worker made
a new one, three round trips, for every job.) A read may so answer an entry that a claim made
since has seen (took, or passed over): that is no news (JobQueue.news), and a new read, after
what the claim saw, goes on waiting. A job taken by the standing claim below wakes its worker's
read too (the read was sent before it): that answer is neither parsed on the way to the job's
start nor followed by a claim.

A worker without GPUs also leaves its next claim standing with its JobQueue while it waits, while
the fast path is on (fast_path.py; queue/fast_path.py `Standing`): the first enqueue to one of its
queues through that JobQueue sends the claim right after its own call, in the same round trip, and
the job starts with no claim round trip after its enqueue. In a single-machine pool the server
enqueues through the JobQueue its slots claim through, so an idle pool starts a job one round trip
to Redis after the client's request reached the server. What the claim takes is what any claim
takes (claim.lua: the head of the queue, FIFO; it stands for no queue after one whose head job
the worker's claims keep, queue/fast_path.py `stand`), and it stays unanswered until its reply is
read here, as any claim does, so a worker stopped in between settles it (JobQueue.settle_claims). It
goes only while the worker may claim (its heartbeats succeed, no pause after a Redis restart:
claim_gate.py), and a pilot's lifetime in it is counted down while it stands. A GPU worker leaves
none: its claim carries NVML's readings of free memory, which would age while it stands."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from daemon.aio import cancel_and_wait
from daemon.job import Lease
from daemon.queue.job_queue import JobQueue
from daemon.queue.work_read import WorkRead

WAIT_BLOCK = 5.0  # longest blocking read for work before claiming again (a safety net only)


class WorkWatch:
    """The blocking read, and the standing claim, of worker `worker` on `queues`. `close()` at
    the end."""

    def __init__(self, queue: JobQueue, worker: str, queues: Sequence[str]) -> None:
        self.queue = queue
        self.worker = worker
        self.queues = list(queues)
        self._read: WorkRead | None = None  # from one wait to the next, until it has answered

    async def wait(self, wake: asyncio.Event, claim: dict[str, Any] | None) -> list[Lease] | None:
        """Until one of the queues gets an entry no claim has seen, `wake` is set, or the claim
        left standing meanwhile was sent. `claim`: that claim, as claim_many's keyword arguments
        and `count` (None: none stands). Returns what the claim got once it was sent (maybe
        nothing), else None."""
        standing = self.queue.stand(self.worker, self.queues, **claim) if claim is not None else None
        woken = asyncio.ensure_future(wake.wait())
        taken = asyncio.ensure_future(standing.taken.wait()) if standing is not None else woken
        got = None
        try:
            while True:
                read = self._read = self._read or self.queue.read_for_work(self.queues, WAIT_BLOCK)
                answering = asyncio.ensure_future(read.answer())
                try:
                    await asyncio.wait({answering, woken, taken}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    # Not read meanwhile: a reply that comes waits for the next wait (work_read.py).
                    await cancel_and_wait(answering)
                if not read.woken or self.queue.news(read.woken):
                    break  # not answered, or timed out (a claim then, as a safety net), or news
                # It answered what a claim has seen since: a new read, after that, waits on.
                self._read = None
                await read.close()
                if woken.done() or taken.done():
                    break
            if standing is not None and not self.queue.withdraw(standing):  # sent: its jobs
                got = await self.queue.standing_claimed(standing)
        finally:
            if standing is not None:
                self.queue.withdraw(standing)  # never left standing for a worker not waiting
            # These waits hold nothing: cancelled, they end in the next turn by themselves.
            woken.cancel()
            taken.cancel()
        failed = None if answering.cancelled() else answering.exception()
        if failed is not None or read.woken is not None:
            self._read = None  # over: the next wait sends a new one, after the claims since
            await read.close()
        if failed is not None and got is None:
            raise failed
        return got

    async def close(self) -> None:
        """End the read in flight, if any."""
        if self._read is not None:
            read, self._read = self._read, None
            await read.close()
