"""What the pool knows of its jobs, read-only: records, listings, depths, logs, events.

`QueueReads` is the reading half of `queue.JobQueue` (which adds every state change): a mixin
over the same Redis client. Nothing here changes a job, so nothing here needs a script; the one
write is `list_jobs` dropping index entries whose records have expired.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, cast

import msgpack
import orjson
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from daemon.errors import JobNotFound
from daemon.job import Attempt, JobInfo, JobSpec, JobState, queue_of
from daemon.queue import keys
from daemon.queue.connection import AnyRedis, block_limit

LOG_GAP = "[gpupool] {} bytes of output dropped here: a log keeps its first {} and its last {}\n"

Entries = list[tuple[bytes, dict[bytes, bytes]]]


async def xread(
    redis: AnyRedis, streams: dict[str, str], *, block: float, count: int | None = None
) -> list[tuple[str, Entries]]:
    """XREAD BLOCK with the reply typed: [(stream name, [(entry id, fields)])]; [] on timeout. It
    blocks for at most `connection.block_limit`, however long `block` asks: callers loop anyway.
    On a Redis Cluster, where one command's keys must share a slot, streams of several slots
    (queues) are read by one XREAD per slot at once, and the first to answer with entries
    answers; the others are cancelled (redis-py drops their connections)."""
    ms = max(1, round(min(block, block_limit(redis)) * 1000))
    if isinstance(redis, RedisCluster):
        by_slot: dict[int, dict[str, str]] = {}
        for name, cursor in streams.items():
            by_slot.setdefault(redis.keyslot(name), {})[name] = cursor
        if len(by_slot) > 1:
            return await _first_read(redis, list(by_slot.values()), count, ms)
    return _named(await redis.xread(streams, count=count, block=ms))  # type: ignore[arg-type]


async def _first_read(
    redis: RedisCluster, groups: list[dict[str, str]], count: int | None, ms: int
) -> list[tuple[str, Entries]]:
    reads = {asyncio.ensure_future(redis.xread(g, count=count, block=ms)) for g in groups}  # type: ignore[arg-type]
    try:
        while reads:
            done, reads = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            got = [entry for read in done for entry in _named(read.result())]
            if got:
                return got
        return []
    finally:
        for read in reads:
            read.cancel()
        await asyncio.gather(*reads, return_exceptions=True)


def _named(got: Any) -> list[tuple[str, Entries]]:
    return [(_s(name), entries) for name, entries in cast(list[tuple[bytes, Entries]], got or [])]


async def xrange(redis: AnyRedis, stream: str, start: str, count: int | None = None) -> Entries:
    return cast(Entries, await redis.xrange(stream, start, "+", count=count))


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _seconds(ms: bytes | None) -> float | None:
    return int(ms) / 1000 if ms else None


class QueueReads:
    """Reads of the queue's keys (daemon/queue/keys.py); `JobQueue` is one."""

    redis: AnyRedis
    log_head: int
    log_tail: int

    async def read_log(
        self, job_id: str, after: str = "0-0", *, count: int = 200, block: float | None = None
    ) -> list[tuple[str, bytes]]:
        """Log chunks after the entry id `after`, oldest first: (entry id, bytes). With `block`,
        waits up to that many seconds for the first new chunk (a blocking read). Where output was
        dropped to keep the log within its bound, a line says how much (log.lua)."""
        stream = keys.log(job_id)
        if block is None:
            entries = await xrange(self.redis, stream, f"({after}" if after != "0-0" else "-", count)
        else:
            got = await xread(self.redis, {stream: after}, count=count, block=block)
            entries = got[0][1] if got else []
        return await self._chunks(job_id, entries)

    async def follow_log(
        self, job_id: str, after: str, ended_after: str, *, block: float, count: int = 200
    ) -> tuple[list[tuple[str, bytes]], bool]:
        """Waits up to `block` seconds for log chunks after `after` (as `read_log` returns them) or
        for a terminal event of the job's queue after the entry id `ended_after`, whichever comes
        first: one blocking read of both streams, so that a follower learns of the job's end at
        once rather than when its read times out. Returns the chunks and whether a job of the
        queue (this one, perhaps) has ended since `ended_after`."""
        log, events = keys.log(job_id), keys.events(queue_of(job_id))
        got = dict(await xread(self.redis, {log: after, events: ended_after}, count=count, block=block))
        return await self._chunks(job_id, got.get(log, [])), events in got

    async def _chunks(self, job_id: str, entries: Entries) -> list[tuple[str, bytes]]:
        out = []
        for entry_id, fields in entries:
            data = fields.get(b"d", b"")
            if b"gap" in fields:  # where the head ends: say what was dropped after it, if anything
                dropped = int(await self.redis.hget(keys.job(job_id), "log_dropped") or 0)
                gap = LOG_GAP.format(dropped, _size(self.log_head), _size(self.log_tail))
                data = gap.encode() if dropped else b""
            out.append((_s(entry_id), data))
        return out

    async def last_event_id(self, queue: str) -> str:
        """The id of the newest terminal event of `queue` (to wait for events after it)."""
        newest = cast(Entries, await self.redis.xrevrange(keys.events(queue), "+", "-", count=1))
        return _s(newest[0][0]) if newest else "0-0"

    # -- reads ----------------------------------------------------------------------------------

    async def queues(self) -> list[str]:
        return sorted(_s(q) for q in await self.redis.smembers(keys.QUEUES))

    async def unended(self, user: str, queues: Sequence[str]) -> dict[str, int]:
        """How many jobs `user` has queued or running in each of `queues` (lib/finish.lua `unended`)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for q in queues:
                pipe.hget(keys.unended(q), user)
            counts = await pipe.execute()
        return {q: int(n or 0) for q, n in zip(queues, counts, strict=True)}

    async def get(self, job_id: str) -> JobInfo:
        """Everything known of a job, with its attempt history. Raises JobNotFound."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.job(job_id))
            pipe.lrange(keys.attempts(job_id), 0, -1)
            record, history = await pipe.execute()
        if not record:
            raise JobNotFound(job_id)
        return _job_info(record, history)

    async def get_many(self, job_ids: Sequence[str]) -> list[JobInfo]:
        """`get` of each of `job_ids`, in order, in one round trip. Raises JobNotFound for the
        first that is not there."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(keys.job(job_id))
                pipe.lrange(keys.attempts(job_id), 0, -1)
            answers = await pipe.execute()
        out = []
        for job_id, record, history in zip(job_ids, answers[::2], answers[1::2], strict=True):
            if not record:
                raise JobNotFound(job_id)
            out.append(_job_info(record, history))
        return out

    async def list_jobs(
        self, queue: str | None = None, *, include_finished: bool = False, limit: int = 1000
    ) -> list[JobInfo]:
        """The queued and running jobs, running first, then in the order they will start (each
        queue's claim order: its front, its priorities, its stream), at most `limit` of them, the
        queued ones kept first; or with `include_finished` the newest `limit` jobs still retained,
        in enqueue order."""
        out: list[JobInfo] = []
        rank: dict[str, int] = {}  # a job's place in its queue's claim order
        for q in [queue] if queue else await self.queues():
            if include_finished:
                newest = cast(list[bytes], await self.redis.zrange(keys.jobs(q), -limit, -1))
                ids = [_s(i) for i in newest]
            else:
                ids = await self._active_ids(q, limit)
                rank.update((job_id, i) for i, job_id in enumerate(ids))
            async with self.redis.pipeline(transaction=False) as pipe:
                for job_id in ids:
                    pipe.hgetall(keys.job(job_id))
                records = await pipe.execute()
            stale = [i for i, r in zip(ids, records, strict=True) if not r]
            if stale:  # records past retention: drop them from the index too
                await self.redis.zrem(keys.jobs(q), *stale)
            out += [_job_info(r, []) for r in records if r]
        if include_finished:
            out.sort(key=lambda j: (j.enqueued_at, j.seq))
            return out[-limit:]
        out.sort(key=lambda j: (j.state is not JobState.RUNNING, rank[j.id], j.enqueued_at, j.seq))
        running = [j for j in out if j.state is JobState.RUNNING]
        queued = out[len(running) :][:limit]  # past `limit`: the queued ones that start soonest,
        return running[len(running) - (limit - len(queued)) :] + queued  # and the running that fit

    async def start_order(self, queue: str, limit: int = 1000) -> list[str]:
        """The ids of `queue`'s queued jobs in the order they will start, as `list_jobs` lists them
        (its front, priorities, stream, then those waiting for others), the records not read."""
        running = {_s(i) for i in cast(list[bytes], await self.redis.zrange(keys.leases(queue), 0, -1))}
        return [i for i in await self._active_ids(queue, limit) if i not in running]

    async def _active_ids(self, queue: str, limit: int) -> list[str]:
        """Running (leases), front (retry), parked, held at a cap, retries backing off (by when they
        are due) and priority jobs of one queue, then up to
        `limit` of its stream entries not yet delivered, read from the consumer group's last
        delivered id on: the order a claim takes them in (claim.lua); last, the jobs that wait for
        others to end (daemon/after.py)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrange(keys.leases(queue), 0, -1)
            for aside in (keys.front(queue), keys.parked(queue), keys.capped(queue)):
                pipe.zrange(aside, 0, limit - 1, withscores=True)
            pipe.zrange(keys.backoff(queue), 0, limit - 1)
            pipe.zrange(keys.priority(queue), 0, limit - 1)
            pipe.zrange(keys.waiting(queue), 0, limit - 1)
            pipe.xinfo_groups(keys.stream(queue))
            try:
                running, retry, parked, capped, backing_off, prio, held, groups = await pipe.execute()
            except ResponseError:  # no stream yet: nothing was ever enqueued
                return []
        # The front, as a claim merges it: by seq (a parked job's score is GPUs * 2**32 + seq).
        front = sorted((int(score) % 2**32, _s(i)) for i, score in retry + parked + capped)
        last = next((g["last-delivered-id"] for g in groups if _s(g["name"]) == keys.GROUP), b"0-0")
        entries = await xrange(self.redis, keys.stream(queue), f"({_s(last)}", limit)
        waiting = [_s(e[1][b"job"]) for e in entries if b"job" in e[1]]
        ahead = [_s(i) for i in running] + [i for _, i in front] + [_s(i) for i in backing_off + prio]
        return list(dict.fromkeys(ahead + waiting + [_s(i) for i in held]))  # held: after the rest

    async def retry_at(self, job_id: str) -> float | None:
        """When a failed job backing off before its retry goes back to the front (Unix time), or
        None when it is not backing off (complete.lua, retry_backoff)."""
        at = await self.redis.zscore(keys.backoff(queue_of(job_id)), job_id)
        return None if at is None else at / 1000

    async def reservation(self, job_id: str) -> tuple[str, float] | None:
        """When `job_id` heads its queue waiting for GPUs and holds a live reservation (claim.lua's
        backfill): the worker it reserved and when it could start there at the earliest (a Unix
        time; now or earlier when its running jobs have no time limits). Else None."""
        r = await self.redis.hmget(keys.reservation(queue_of(job_id)), "job", "worker", "until", "at")
        job, worker, until, at = (None if v is None else _s(v) for v in r)
        if job != job_id or worker is None or until is None or float(until) < time.time() * 1000:
            return None
        return worker, float(at or 0) / 1000

    async def leases_held(self, queues: Sequence[str]) -> int:
        """Running attempts (leases) in `queues`, in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for q in queues:
                pipe.zcard(keys.leases(q))
            return sum(int(n) for n in await pipe.execute())

    async def depth(self, queue: str) -> int:
        """Jobs waiting in `queue`: those at its front, parked, held at a cap or backing off before
        a retry, and stream entries not yet delivered (the others are pending: running, or at the
        front, parked, held or backing off)."""
        return (await self.depths([queue]))[queue]

    async def depths(self, queues: Sequence[str]) -> dict[str, int]:
        """`depth` of each of `queues`, in one round trip whatever their number."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for q in queues:
                for aside in (keys.front(q), keys.parked(q), keys.capped(q), keys.backoff(q)):
                    pipe.zcard(aside)
                pipe.xlen(keys.stream(q))
                pipe.xpending(keys.stream(q), keys.GROUP)
            replies = await pipe.execute(raise_on_error=False)
        out = {}
        for i, q in enumerate(queues):
            retry, parked, capped, backing_off, length, pending = replies[6 * i : 6 * i + 6]
            # no stream or group yet (an error in its place): nothing was ever enqueued
            waiting = (
                int(retry)
                + int(parked)
                + int(capped)
                + int(backing_off)
                + int(length)
                - int(pending["pending"])
                if not isinstance(pending, Exception)
                else 0
            )
            out[q] = waiting
        return out


def _size(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n / 1024:g} KiB"


def _job_info(record: dict[bytes, bytes], history: list[bytes]) -> JobInfo:
    get = record.get
    exit_code = get(b"exit_code")
    result = msgpack.unpackb(get(b"result")) if get(b"result") else {}
    gpu_usage = result.pop("gpu_usage", None)  # carried in the outcome's result (worker/gpu_usage.py)
    return JobInfo(
        id=_s(record[b"id"]),
        state=JobState(_s(record[b"state"])),
        spec=JobSpec.from_dict(msgpack.unpackb(record[b"spec"])),
        seq=int(record[b"seq"]),
        attempt=int(record[b"attempt"]),
        worker=_s(get(b"worker", b"")),
        enqueued_at=int(record[b"enqueued_at"]) / 1000,
        started_at=_seconds(get(b"started_at")),
        ended_at=_seconds(get(b"ended_at")),
        exit_code=int(exit_code) if exit_code else None,
        detail=_s(get(b"detail", b"")),
        cancel_requested=get(b"cancel") == b"1",
        attempts=tuple(_attempt(orjson.loads(h)) for h in history),
        result=result,
        lease=_s(get(b"lease", b"")),
        checkpoint=_s(get(b"checkpoint", b"")),
        gpu_usage=gpu_usage,
        idle_gpu=orjson.loads(idle) if (idle := get(b"idle_gpu")) else None,
    )


def _attempt(data: dict[str, Any]) -> Attempt:
    ended = data.get("ended_at")
    return Attempt(
        attempt=int(data["attempt"]),
        worker=str(data["worker"]),
        started_at=data["started_at"] / 1000,
        ended_at=ended / 1000 if ended else None,
        how=str(data["how"]),
        lease=str(data.get("lease", "")),
    )
