"""The job queue on Redis Streams: enqueue, claim, renew, complete, cancel, reclaim, and reads.

Every state change is one Lua script (daemon/lua/, each saying what it guarantees), so a change
either happens whole or not at all, under any number of concurrent clients and workers. Keys are
named in daemon/keys.py. Times stored in Redis are Redis server time in milliseconds; this module
hands out seconds (floats).

Work wakes workers without polling: `claim` returns a cursor per queue, and `wait_for_work`
blocks (XREAD BLOCK) until an entry newer than the cursors is added to one of the streams.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import msgpack
import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from daemon import keys
from daemon.errors import InvalidJob, JobNotFound, StaleAttempt
from daemon.job import Attempt, JobInfo, JobSpec, JobState, Lease, Outcome, RenewStatus, new_job_id
from daemon.redis_conn import block_limit
from daemon.scripts import Pipeliner, ScriptBatch, Scripts

log = logging.getLogger(__name__)

DEFAULT_RETENTION = 7 * 24 * 3600
RECLAIM_BATCH = 500
ENQUEUE_CHUNK = 100  # jobs per enqueue_many script call: a few ms of Redis time at most
MAX_IDEMPOTENCY_KEY = 200
LOG_CAP = 5000  # log stream entries kept per job; a worker sends chunks of up to 64 KiB


Entries = list[tuple[bytes, dict[bytes, bytes]]]


async def xread(
    redis: Redis, streams: dict[str, str], *, block: float, count: int | None = None
) -> list[tuple[str, Entries]]:
    """XREAD BLOCK with the reply typed: [(stream name, [(entry id, fields)])]; [] on timeout. It
    blocks for at most `redis_conn.block_limit`, however long `block` asks: callers loop anyway."""
    block = min(block, block_limit(redis))
    got = await redis.xread(streams, count=count, block=max(1, round(block * 1000)))  # type: ignore[arg-type]
    return [(_s(name), entries) for name, entries in cast(list[tuple[bytes, Entries]], got or [])]


async def xrange(redis: Redis, stream: str, start: str, count: int | None = None) -> Entries:
    return cast(Entries, await redis.xrange(stream, start, "+", count=count))


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _seconds(ms: bytes | None) -> float | None:
    return int(ms) / 1000 if ms else None


def _raise_if_stale(lease: Lease, reply: Sequence[Any]) -> None:
    """A fenced script's `{'stale', state, attempt}` answer: the attempt is no longer current."""
    if reply[0] == b"stale":
        raise StaleAttempt(
            lease.job_id, lease.attempt, f"the job is {_s(reply[1])} at attempt {_s(reply[2])}"
        )


def job_queue_of(job_id: str) -> str:
    """The queue of a job id, or InvalidJob naming the id (ids come from users)."""
    try:
        return keys.queue_of(job_id)
    except ValueError as exc:
        raise InvalidJob("id", str(exc)) from None


class JobQueue:
    """All queue operations of one pool, over one Redis client (a connection pool)."""

    def __init__(
        self,
        redis: Redis,
        *,
        lease_seconds: float = 300.0,
        retention_seconds: int = DEFAULT_RETENTION,
    ) -> None:
        self.redis = redis
        self.lease_ms = max(1, round(lease_seconds * 1000))
        self.retention = retention_seconds
        self.scripts = Scripts(redis)
        # Script calls made in one event-loop turn share a round trip (scripts.Pipeliner).
        self._call = Pipeliner(redis)
        self._cursors: dict[str, str] = {}
        self._known_queues: set[str] = set()

    # -- submit ---------------------------------------------------------------------------------

    async def enqueue(self, spec: JobSpec, idempotency_key: str | None = None) -> tuple[str, bool]:
        """Add a job at the tail of its queue. Returns (job id, created); `created` is False when the
        idempotency key was used before, and the id is then that first job's."""
        if idempotency_key is not None and not 0 < len(idempotency_key) <= MAX_IDEMPOTENCY_KEY:
            raise InvalidJob("idempotency key", f"must be 1 to {MAX_IDEMPOTENCY_KEY} characters")
        await self._register_queue(spec.queue)
        q = spec.queue
        packed = msgpack.packb(spec.to_dict())
        while True:
            job_id = new_job_id(q)
            job_keys = [keys.stream(q), keys.jobs(q), keys.seq(q), keys.job(job_id)]
            if idempotency_key is not None:
                job_keys.append(keys.idempotency(q, idempotency_key))
            try:
                got, created = await self._call(
                    self.scripts.enqueue,
                    job_keys,
                    [keys.GROUP, job_id, packed, spec.gpus, spec.max_attempts, spec.retries],
                )
            except ResponseError as exc:
                if str(exc).startswith("ID_TAKEN"):
                    continue  # two ids drawn in the same millisecond collided: draw again
                raise
            return _s(got), bool(created)

    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[str]:
        """Enqueue several jobs in one round trip, in order: one script call per run of up to
        ENQUEUE_CHUNK jobs of one queue, the calls pipelined."""
        for q in {s.queue for s in specs}:
            await self._register_queue(q)
        chunks: list[list[JobSpec]] = []
        for spec in specs:
            if chunks and chunks[-1][0].queue == spec.queue and len(chunks[-1]) < ENQUEUE_CHUNK:
                chunks[-1].append(spec)
            else:
                chunks.append([spec])
        batch = ScriptBatch(self.redis)
        for chunk in chunks:
            q = chunk[0].queue
            ids = [new_job_id(q) for _ in chunk]
            args: list[Any] = [keys.GROUP, keys.queue_prefix(q)]
            for spec, job_id in zip(chunk, ids, strict=True):
                args += [job_id, msgpack.packb(spec.to_dict()), spec.gpus, spec.max_attempts, spec.retries]
            job_keys = [keys.job(job_id) for job_id in ids]
            batch.add(self.scripts.enqueue_many, [keys.stream(q), keys.jobs(q), keys.seq(q), *job_keys], args)
        return [_s(job_id) for reply in await batch.execute() for job_id in reply]

    async def _register_queue(self, queue: str) -> None:
        # The pool-wide queue set has its own hash tag, so it cannot be in the enqueue script.
        # Adding it first means a listed queue may be empty, never that a queue with jobs is unlisted.
        if queue not in self._known_queues:
            await self.redis.sadd(keys.QUEUES, queue)
            self._known_queues.add(queue)

    # -- work -----------------------------------------------------------------------------------

    async def claim(
        self, worker: str, queues: Sequence[str], gpus_free: int = 0, default_gpus: int = 0
    ) -> Lease | None:
        """The next job for `worker`, trying `queues` in priority order; None when none has work
        this worker can take. A job asking for 0 GPUs needs `default_gpus` free (a worker's share
        per slot). Never blocks: see `wait_for_work`."""
        leases = await self.claim_many(worker, queues, 1, gpus_free, default_gpus)
        return leases[0] if leases else None

    async def claim_many(
        self, worker: str, queues: Sequence[str], count: int, gpus_free: int = 0, default_gpus: int = 0
    ) -> list[Lease]:
        """Up to `count` next jobs for `worker` (a worker with that many free slots), in queue
        priority order then each queue's order, one script call per queue tried; GPUs as in
        `claim`, the ones a claimed job takes counted out for the next. [] when none has work."""
        leases: list[Lease] = []
        for q in queues:
            if len(leases) >= count:
                break
            try:
                reply = await self._call(
                    self.scripts.claim,
                    [keys.stream(q), keys.retry(q), keys.leases(q)],
                    [
                        keys.queue_prefix(q),
                        keys.GROUP,
                        worker,
                        gpus_free,
                        self.lease_ms,
                        default_gpus,
                        count - len(leases),
                    ],
                )
            except RedisError:
                if not leases:
                    raise
                # Claimed jobs are this worker's now: hand them out rather than strand them.
                log.warning("claiming from queue %s failed; running the %d jobs claimed", q, len(leases))
                break
            status, cursor, *claimed = reply
            for i in range(0, len(claimed), 3):
                job_id, attempt, spec = claimed[i : i + 3]
                lease = Lease(_s(job_id), int(attempt), worker, JobSpec.from_dict(msgpack.unpackb(spec)))
                gpus_free -= lease.spec.gpus or default_gpus
                leases.append(lease)
            if status != b"claimed":
                self._cursors[q] = _s(cursor)
        return leases

    async def wait_for_work(self, queues: Sequence[str], block: float) -> bool:
        """Block until one of `queues` gets an entry newer than what the last `claim` saw, or until
        `block` seconds pass. True when woken by an entry. A blocking read, not polling."""
        streams = {keys.stream(q): self._cursors.get(q, "0-0") for q in queues}
        return bool(await xread(self.redis, streams, count=1, block=block))

    async def renew(self, worker: str, leases: Iterable[Lease]) -> dict[str, RenewStatus]:
        """Extend all of a worker's leases in one round trip (one script call per queue, pipelined).
        A lease that was reclaimed answers LOST and is not taken back."""
        batch = ScriptBatch(self.redis)
        answers = self.add_renewals(batch, worker, leases)
        return answers(await batch.execute())

    def add_renewals(
        self, batch: ScriptBatch, worker: str, leases: Iterable[Lease]
    ) -> Callable[[Sequence[Any]], dict[str, RenewStatus]]:
        """Add the renewals of `renew` to `batch` (so a heartbeat can send them in the same round
        trip as other calls); returns the function that reads their answers from the batch's
        replies once it has run."""
        by_queue: dict[str, list[Lease]] = {}
        for lease in leases:
            by_queue.setdefault(lease.queue, []).append(lease)
        calls: list[tuple[int, list[Lease]]] = []
        for q, held in by_queue.items():
            args: list[Any] = [keys.queue_prefix(q), worker, self.lease_ms]
            for lease in held:
                args += [lease.job_id, lease.attempt]
            calls.append((batch.add(self.scripts.renew, [keys.leases(q)], args), held))

        def answers(replies: Sequence[Any]) -> dict[str, RenewStatus]:
            out: dict[str, RenewStatus] = {}
            for index, held in calls:
                for lease, answer in zip(held, replies[index], strict=True):
                    out[lease.job_id] = RenewStatus(_s(answer))
            return out

        return answers

    async def complete(self, lease: Lease, outcome: Outcome) -> JobState:
        """Record how an attempt ended. Returns the job's state afterwards (QUEUED when a failed job
        goes back for a retry). Raises StaleAttempt, changing nothing, when `lease` is no longer the
        job's current attempt (it was reclaimed, or already completed)."""
        q = lease.queue
        reply = await self._call(
            self.scripts.complete,
            [keys.stream(q), keys.leases(q), keys.events(q), keys.retry(q)],
            [
                keys.queue_prefix(q),
                keys.GROUP,
                lease.worker,
                lease.job_id,
                lease.attempt,
                str(outcome.state),
                "" if outcome.exit_code is None else outcome.exit_code,
                outcome.detail,
                msgpack.packb(dict(outcome.result)),
                self.retention,
            ],
        )
        _raise_if_stale(lease, reply)
        return JobState.QUEUED if reply[0] == b"retry" else outcome.state

    async def release(self, lease: Lease) -> JobState:
        """Hand an attempt back that this worker stopped before its job finished (a drain): the job
        goes to the front of its queue and is claimed next with attempt+1; a hand-back does not
        count towards max_attempts. Returns QUEUED, or CANCELLED when the user cancelled it
        meanwhile. Raises StaleAttempt, changing nothing, when `lease` is no longer current."""
        q = lease.queue
        reply = await self._call(
            self.scripts.release,
            [keys.stream(q), keys.retry(q), keys.leases(q), keys.events(q)],
            [
                keys.queue_prefix(q),
                keys.GROUP,
                lease.worker,
                lease.job_id,
                lease.attempt,
                self.retention,
            ],
        )
        _raise_if_stale(lease, reply)
        return JobState(_s(reply[0]))

    async def cancel(self, job_id: str) -> str:
        """Cancel a job: 'cancelled' (it was queued and will never start), 'cancelling' (it runs; its
        worker stops it), or the terminal state it already had. Raises JobNotFound."""
        q = job_queue_of(job_id)
        state = _s(
            await self._call(
                self.scripts.cancel,
                [keys.stream(q), keys.retry(q), keys.events(q)],
                [keys.queue_prefix(q), keys.GROUP, job_id, self.retention],
            )
        )
        if state == "missing":
            raise JobNotFound(job_id)
        if state == "cancelling":
            # Nudge the job's worker so it stops the job now rather than at its next heartbeat;
            # if the nudge is lost, that heartbeat (renew answers CANCEL) does the same.
            worker = await self.redis.hget(keys.job(job_id), "worker")
            if worker:
                await self.redis.publish(keys.worker_channel(_s(worker)), job_id)
        return state

    async def reclaim(self, queues: Iterable[str] | None = None) -> list[tuple[str, JobState]]:
        """Take back every attempt whose lease deadline passed: its job goes to the front of its
        queue (or to cancelled / dead). Returns (job id, new state) for each."""
        out: list[tuple[str, JobState]] = []
        for q in await self.queues() if queues is None else queues:
            while True:
                reply = await self.scripts.reclaim(
                    keys=[keys.stream(q), keys.retry(q), keys.leases(q), keys.events(q)],
                    args=[keys.queue_prefix(q), keys.GROUP, RECLAIM_BATCH, self.retention],
                )
                pairs = [(_s(reply[i]), JobState(_s(reply[i + 1]))) for i in range(0, len(reply), 2)]
                out += pairs
                if len(pairs) < RECLAIM_BATCH:
                    break
        for job_id, state in out:
            log.warning("job %s: lease expired, now %s", job_id, state)
        return out

    async def append_log(self, lease: Lease, chunks: Sequence[bytes]) -> None:
        """Append output of an attempt to its job's log (capped at LOG_CAP entries). Raises
        StaleAttempt, writing nothing, when the attempt is no longer current."""
        answer = await self._call(
            self.scripts.log,
            [keys.job(lease.job_id), keys.log(lease.job_id)],
            [lease.worker, lease.attempt, LOG_CAP, *chunks],
        )
        if answer == b"stale":
            raise StaleAttempt(lease.job_id, lease.attempt, "its log is closed to it")

    async def read_log(
        self, job_id: str, after: str = "0-0", *, count: int = 200, block: float | None = None
    ) -> list[tuple[str, bytes]]:
        """Log chunks after the entry id `after`, oldest first: (entry id, bytes). With `block`,
        waits up to that many seconds for the first new chunk (a blocking read)."""
        job_queue_of(job_id)
        stream = keys.log(job_id)
        if block is None:
            entries = await xrange(self.redis, stream, f"({after}" if after != "0-0" else "-", count)
        else:
            got = await xread(self.redis, {stream: after}, count=count, block=block)
            entries = got[0][1] if got else []
        return [(_s(entry_id), fields[b"d"]) for entry_id, fields in entries]

    async def last_event_id(self, queue: str) -> str:
        """The id of the newest terminal event of `queue` (to wait for events after it)."""
        newest = cast(Entries, await self.redis.xrevrange(keys.events(queue), "+", "-", count=1))
        return _s(newest[0][0]) if newest else "0-0"

    # -- reads ----------------------------------------------------------------------------------

    async def queues(self) -> list[str]:
        return sorted(_s(q) for q in await self.redis.smembers(keys.QUEUES))

    async def get(self, job_id: str) -> JobInfo:
        """Everything known of a job, with its attempt history. Raises JobNotFound."""
        job_queue_of(job_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.job(job_id))
            pipe.lrange(keys.attempts(job_id), 0, -1)
            record, history = await pipe.execute()
        if not record:
            raise JobNotFound(job_id)
        return _job_info(record, history)

    async def list_jobs(
        self, queue: str | None = None, *, include_finished: bool = False, limit: int = 1000
    ) -> list[JobInfo]:
        """Jobs in enqueue order: the queued and running ones, or with `include_finished` the newest
        `limit` jobs still retained."""
        out: list[JobInfo] = []
        for q in [queue] if queue else await self.queues():
            if include_finished:
                newest = cast(list[bytes], await self.redis.zrange(keys.jobs(q), -limit, -1))
                ids = [_s(i) for i in newest]
            else:
                ids = await self._active_ids(q, limit)
            async with self.redis.pipeline(transaction=False) as pipe:
                for job_id in ids:
                    pipe.hgetall(keys.job(job_id))
                records = await pipe.execute()
            stale = [i for i, r in zip(ids, records, strict=True) if not r]
            if stale:  # records past retention: drop them from the index too
                await self.redis.zrem(keys.jobs(q), *stale)
            out += [_job_info(r, []) for r in records if r]
        out.sort(key=lambda j: (j.enqueued_at, j.seq))
        return out[-limit:]

    async def _active_ids(self, queue: str, limit: int) -> list[str]:
        """Running (leases), reclaimed (retry) and never-delivered stream entries of one queue."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrange(keys.leases(queue), 0, -1)
            pipe.zrange(keys.retry(queue), 0, -1)
            pipe.xrange(keys.stream(queue), "-", "+", count=limit)
            running, retry, entries = await pipe.execute()
        pending = {_s(e[1][b"job"]) for e in entries if b"job" in e[1]}
        return list(dict.fromkeys([_s(i) for i in running + retry] + sorted(pending)))

    async def depth(self, queue: str) -> int:
        """Jobs waiting in `queue`: reclaimed ones plus stream entries not yet delivered."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zcard(keys.retry(queue))
            pipe.xlen(keys.stream(queue))
            pipe.xpending(keys.stream(queue), keys.GROUP)
            try:
                retry, length, pending = await pipe.execute()
            except ResponseError:  # no stream or group yet: nothing was ever enqueued
                return 0
        return int(retry) + int(length) - int(pending["pending"])


def _job_info(record: dict[bytes, bytes], history: list[bytes]) -> JobInfo:
    get = record.get
    exit_code = get(b"exit_code")
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
        result=msgpack.unpackb(get(b"result")) if get(b"result") else {},
    )


def _attempt(data: dict[str, Any]) -> Attempt:
    ended = data.get("ended_at")
    return Attempt(
        attempt=int(data["attempt"]),
        worker=str(data["worker"]),
        started_at=data["started_at"] / 1000,
        ended_at=ended / 1000 if ended else None,
        how=str(data["how"]),
    )
