"""What one user's submissions may hold of the pool's Redis: the bytes they stored within the
retention, over every queue (`max_stored`, lua/store.lua), and, before a batch over several
queues is written, their jobs not ended in each (`max_unended`). A mixin of JobQueue, which sets
the attributes below; the enqueue scripts judge each queue's count again, atomically.

A user's bytes are counted before a submission is written, in a script of their own (a user's key
and a queue's keys are in different slots of a Cluster, so one script cannot hold both), and given
back when the submission then wrote nothing.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from redis.exceptions import RedisError, ResponseError

from daemon.errors import TooManyUnended, TooMuchStored
from daemon.job import JobSpec
from daemon.queue import keys
from daemon.queue.reads import _s
from daemon.queue.scripts import Calls, Scripts

# Bytes counted for each job's record against its user's user_max_stored_bytes, beside its spec:
# the rest of its hash, its index and stream entries, its attempts, outcome and end event: above
# what one job run to its end adds to Redis's used_memory (its log, bounded by job_log_max_bytes,
# apart).
RECORD_BYTES = 6 * 1024


class UserRoom:
    """The per-user bounds of a JobQueue's submissions (which sets these attributes)."""

    scripts: Scripts
    _call: Calls
    max_stored: int
    max_unended: int
    retention: int

    async def unended(self, user: str, queues: Sequence[str]) -> dict[str, int]:
        raise NotImplementedError  # reads.QueueReads's, through JobQueue

    async def _judge_queues(self, specs: Sequence[JobSpec]) -> None:
        """TooManyUnended, before anything is written, when a batch over several queues would take
        a user past `max_unended` in one of them, by the counts as they are (the scripts judge
        each queue's part again, atomically)."""
        per_queue = Counter((s.queue, s.user) for s in specs)
        if not self.max_unended or len({q for q, _ in per_queue}) < 2:
            return
        for (q, user), n in per_queue.items():
            has = (await self.unended(user, [q]))[q]
            if has + n > self.max_unended:
                raise TooManyUnended(user, q, has, n, self.max_unended)

    async def _give_back_refused(
        self,
        specs: Sequence[JobSpec],
        packed: Sequence[bytes],
        chunks: Sequence[Sequence[int]],
        replies: Sequence[Any],
        stored: Mapping[str, tuple[str, int]],
    ) -> None:
        """Give back what `_store` counted for the jobs of the calls Redis refused (a ResponseError:
        at maxmemory, the script wrote nothing); the other calls' jobs were written."""
        not_written: Counter[str] = Counter()
        for chunk, reply in zip(chunks, replies, strict=True):
            if isinstance(reply, ResponseError):
                for i in chunk:
                    not_written[specs[i].user] += RECORD_BYTES + len(packed[i])
        await self._give_back(
            {user: (stored[user][0], n) for user, n in not_written.items() if user in stored}
        )

    async def _store(self, adding: Mapping[str, int]) -> dict[str, tuple[str, int]]:
        """Count `adding` (user -> bytes about to be submitted) against each user's `max_stored`
        (lua/store.lua), all or none: TooMuchStored names the first user it would take past it.
        Returns what was counted (user -> (day, bytes)), for `_give_back`."""
        counted: dict[str, tuple[str, int]] = {}
        if not self.max_stored:
            return counted
        for user, nbytes in adding.items():
            reply = await self._call.submit(
                self.scripts.store, [keys.stored(user)], [nbytes, self.max_stored, self.retention]
            )
            if reply[0] == b"over":
                await self._give_back(counted)
                raise TooMuchStored(user, int(reply[1]), nbytes, self.max_stored, float(reply[2]))
            counted[user] = (_s(reply[1]), nbytes)
        return counted

    async def _give_back(self, counted: Mapping[str, tuple[str, int]]) -> None:
        """Give back what `_store` counted for a submission that then wrote nothing. Best effort:
        should Redis refuse this too, the count stays over, the safe side, and the submission's
        own error is the one to tell."""
        for user, (day, nbytes) in counted.items():
            with contextlib.suppress(RedisError):
                await self._call.submit(
                    self.scripts.store, [keys.stored(user)], [-nbytes, self.max_stored, self.retention, day]
                )
