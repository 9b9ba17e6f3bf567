"""The outbox: the job ends still to be notified, per queue, in Redis (server/notifier.py sends them).

A job enqueued with somewhere to notify (its --notify URL; the pool's notify_url) names those
targets on its record, and the script that ends it puts one entry per target in its queue's
outbox (keys.outbox), in the same step as the end itself: nothing comes between "the job ended"
and "its notification is owed", whatever crashes. An entry leaves the outbox when a server has
delivered it or given it up, or when the job's record expires (job_retention after the end, when
nothing is left to send), or, past the outbox's cap, to make room for a newer end.

A server takes entries on (outbox_take.lua) by making each due a *hold* later, a lease no other
server's take can see through, and settles each (outbox_settle.lua): done, retry after a pause
(any server may take it then), or back (due at once). Its fence is the score its take set: a
server whose hold lapsed (killed, frozen, cut off) changes nothing, and the entry is taken again
by whoever comes next — each end is delivered at least once, and by one server in the normal case.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from daemon.job import queue_of
from daemon.queue import keys
from daemon.queue.job_queue import JobQueue
from daemon.queue.reads import _s

CHUNK = 500  # job ids per take of the ends a server just saw


class Verdict(enum.StrEnum):
    DONE = "done"  # delivered, or given up: out of the outbox
    RETRY = "retry"  # due again after a pause, an attempt counted
    BACK = "back"  # due again at once, uncounted: handed back by a server that stops


@dataclass(frozen=True, slots=True)
class Taken:
    """One entry a server holds: a job's end to one target, until `fence` (Redis time, ms)."""

    job_id: str
    target: str
    fence: int
    tries: int  # the attempts made before this one

    @property
    def member(self) -> str:
        return f"{self.job_id}/{self.target}"


@dataclass(frozen=True, slots=True)
class Took:
    """What a take of one queue's outbox answered."""

    taken: list[Taken]
    pushed_out: int  # ends the cap pushed out since the last sweep (a sweep's answer only)
    expired: int  # ends whose job's record had expired: dropped, never to be sent
    next_due: float | None  # seconds until the first entry left is due (0: now); None: none left


class Outbox:
    """The outboxes of every queue of one pool, through `queue`'s Redis and scripts."""

    def __init__(self, queue: JobQueue, hold: float) -> None:
        """`hold`: seconds a take keeps an entry from every other take (an attempt must fit in it)."""
        self.queue = queue
        self.hold_ms = max(1, math.ceil(hold * 1000))
        self._take = queue.scripts.outbox_take

    async def take_due(self, queues: Sequence[str], most: int) -> list[tuple[str, Took | Exception]]:
        """Up to `most` entries of each of `queues` that are due, those due longest ago first, in
        one round trip: per queue, what its take answered, or its error (the others go on)."""
        batch = self.queue.batch(ack=False)
        for q in queues:
            batch.add(self._take, self._keys(q), [keys.queue_prefix(q), self.hold_ms, most])
        return [(q, _took(r)) for q, r in zip(queues, await batch.execute_each(), strict=True)]

    async def take_ended(self, queue: str, job_ids: Sequence[str], most: int) -> Took:
        """Up to `most` of the due entries of `job_ids`, jobs of `queue` (at most CHUNK: the ends
        a server just saw)."""
        assert len(job_ids) <= CHUNK
        batch = self.queue.batch(ack=False)
        batch.add(self._take, self._keys(queue), [keys.queue_prefix(queue), self.hold_ms, most, *job_ids])
        (reply,) = await batch.execute()
        took = _took(reply)
        assert not isinstance(took, Exception)  # (execute raised it)
        return took

    async def settle(self, taken: Taken, verdict: Verdict, pause: float = 0.0) -> bool:
        """Settle a delivery taken (see Verdict; `pause`: seconds, for RETRY). False when the
        entry was no longer this taker's: its hold lapsed and another took it."""
        (settled,) = await self._settle([taken], verdict, pause)
        return settled

    async def hand_back(self, taken: Sequence[Taken]) -> int:
        """Make entries taken and not sent due at once, in one round trip: how many still were
        this taker's."""
        return sum(await self._settle(taken, Verdict.BACK))

    async def _settle(self, taken: Sequence[Taken], verdict: Verdict, pause: float = 0.0) -> list[bool]:
        batch = self.queue.batch(ack=False)
        for t in taken:
            q = queue_of(t.job_id)
            args = [keys.queue_prefix(q), t.member, t.fence, str(verdict), max(0, round(pause * 1000))]
            batch.add(self.queue.scripts.outbox_settle, [keys.outbox(q)], args)
        return [bool(settled) for settled in await batch.execute()]

    @staticmethod
    def _keys(queue: str) -> list[str]:
        return [keys.outbox(queue), keys.outbox_dropped(queue)]


def _took(reply: Any) -> Took | Exception:
    if isinstance(reply, Exception):
        return reply
    pushed, expired, next_due, *rest = reply
    taken = []
    for i in range(0, len(rest), 3):
        job_id, _, target = _s(rest[i]).rpartition("/")
        taken.append(Taken(job_id, target, int(rest[i + 1]), int(rest[i + 2])))
    return Took(taken, int(pushed), int(expired), None if int(next_due) < 0 else int(next_due) / 1000)
