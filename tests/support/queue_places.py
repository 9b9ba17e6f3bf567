"""Where each job of a queue sits, read from Redis itself: the one check of the queue's bookkeeping
that every test may reuse (issue 46). A job that has not ended is in exactly one place; a job
that ended is in none. Read through daemon/queue/keys.py's names, never through the scripts, so
the check does not share the code it checks.

The places (keys.py says what each key holds):
  stream   its entry is in the stream, not yet delivered to the consumer group (a job with a
           priority has such an entry too: it belongs to its place in `prio`, which deletes it
           as the job starts, so it is counted there, not here)
  front    `retry`: taken back, handed back or retried, claimed before anything not yet started
  backoff  a failed job waiting out its retry back-off before it goes to the front
  parked   passed over by a worker too small for it
  capped   held aside at its user's cap (or, in a fair-share queue, in its user's line): in
           `capped` and in its user's `capped:USER`; in one of the two only is a place of its own,
           'capped without its line' or 'line without capped', so that it never counts as one
  prio     enqueued with a priority and not yet taken
  waiting  held out of the queue for other jobs or its array's window
  running  under a lease (`leases`)
A job whose only trace is an entry delivered to a worker that no lease names has no place: lost.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from daemon.queue import keys
from daemon.queue.connection import AnyRedis

# The sorted sets a queued or running job may sit in, by the place they are.
SET_PLACES = {
    "front": keys.front,
    "backoff": keys.backoff,
    "parked": keys.parked,
    "capped": keys.capped,
    "prio": keys.priority,
    "waiting": keys.waiting,
    "running": keys.leases,
}


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else value or ""


def _entry_id(entry: str) -> tuple[int, int]:
    ms, _, seq = entry.partition("-")
    return int(ms), int(seq or 0)


async def places(redis: AnyRedis, queue: str, job_ids: Iterable[str]) -> dict[str, list[str]]:
    """Every place each of `job_ids` (jobs of `queue`) sits in now, by job id, read in one
    round trip, two with users' lines (all of a queue's keys are in one slot, so this works on a
    Cluster too)."""
    ids = list(job_ids)
    pipe = redis.pipeline(transaction=False)
    for key in SET_PLACES.values():
        pipe.zrange(key(queue), 0, -1)
    pipe.xrange(keys.stream(queue), "-", "+")
    for job_id in ids:
        pipe.hget(keys.job(job_id), "user")
    replies = await pipe.execute()
    members = {place: {_text(m) for m in got} for place, got in zip(SET_PLACES, replies, strict=False)}
    undelivered = await _undelivered(redis, queue, replies[len(SET_PLACES)])
    users = [_text(user) for user in replies[len(SET_PLACES) + 1 :]]
    lines = await _lines(redis, queue, set(users))
    out: dict[str, list[str]] = {}
    for job_id, user in zip(ids, users, strict=True):
        found = [place for place, held in members.items() if job_id in held]
        in_line = job_id in lines.get(user, set())
        if "capped" in found and not in_line:
            found[found.index("capped")] = "capped without its line"
        elif in_line and "capped" not in found:
            found.append("line without capped")
        if job_id in undelivered and "prio" not in found:
            found.append("stream")
        out[job_id] = found
    return out


async def _undelivered(redis: AnyRedis, queue: str, entries: list[Any]) -> set[str]:
    """The jobs whose entries (of `entries`, the whole stream) the consumer group has not
    delivered yet."""
    if not entries:
        return set()
    delivered = "0-0"
    for group in await redis.xinfo_groups(keys.stream(queue)):
        if _text(group["name"]) == keys.GROUP:
            delivered = _text(group["last-delivered-id"])
    after = _entry_id(delivered)
    return {_text(fields.get(b"job")) for entry, fields in entries if _entry_id(_text(entry)) > after}


async def _lines(redis: AnyRedis, queue: str, users: set[str]) -> dict[str, set[str]]:
    """Each user's line of jobs held at a cap or waiting their turn (`capped:USER`: keys.capped's
    key and the user, as lib/caps.lua `hold` names it; keys.py has no name of its own for it)."""
    if not users:
        return {}
    pipe = redis.pipeline(transaction=False)
    for user in sorted(users):
        pipe.zrange(keys.capped(queue) + ":" + user, 0, -1)
    return {
        user: {_text(m) for m in got} for user, got in zip(sorted(users), await pipe.execute(), strict=True)
    }
