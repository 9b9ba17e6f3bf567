"""Which job ends a server has taken on to notify (server/notifier.py), so that one server of a pool
sends each, once.

A claim is one key per job and target (keys.notified; the target is `job` for its --notify URL,
`pool` for notify_url), set only if absent and expiring with the job's record: the first server to
claim it sends; another server of the pool, or the same one reading the event again, finds it taken.
A server that stops before a delivery is done deletes its claim, so that the next start (its own or
another's) finds that end unclaimed among the recent events (`recent_ends`) and sends it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from daemon.queue import keys
from daemon.queue.connection import AnyRedis
from daemon.queue.reads import xrange


async def claim(redis: AnyRedis, job_id: str, target: str, ttl: float) -> bool:
    """Take the end of `job_id` to `target` on; False if another (or an earlier read) has it."""
    return bool(await redis.set(keys.notified(job_id, target), b"1", nx=True, ex=max(1, math.ceil(ttl))))


async def release(redis: AnyRedis, claims: Iterable[tuple[str, str]]) -> None:
    """Hand back (job id, target) claims not delivered, for the next start to send. One key per
    command: on a Redis Cluster the jobs' keys lie in their queues' slots."""
    for job_id, target in claims:
        await redis.delete(keys.notified(job_id, target))


async def recent_ends(redis: AnyRedis, queue: str, since: float, count: int) -> list[str]:
    """The ids of `queue`'s jobs that ended from `since` on (Unix seconds; event ids are the Redis
    clock's milliseconds), oldest first, at most `count`."""
    entries = await xrange(redis, keys.events(queue), f"{max(0, int(since * 1000))}-0", count)
    return [fields[b"job"].decode() for _, fields in entries]
