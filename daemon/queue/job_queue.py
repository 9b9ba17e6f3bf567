"""The job queue on Redis Streams: enqueue, claim, renew, complete, cancel, reclaim (the reads
are reads.QueueReads, the claims claims.Claims, an attempt's own calls from renew to its end
attempt_calls.AttemptCalls, the jobs held for others held.HeldJobs, the count of what each user's
submissions hold user_room.UserRoom, which JobQueue is too).

Every state change is one Lua script (daemon/queue/lua/, each saying what it guarantees), so a change
either happens whole or not at all, under any number of concurrent clients and workers. Keys are
named in daemon/queue/keys.py. Times stored in Redis are Redis server time in milliseconds; this module
hands out seconds (floats).

Work wakes workers without polling: `claim` returns cursors per queue, and `wait_for_work`
blocks (XREAD BLOCK) until an entry newer than them is added to the queue's stream or its `wake`
stream (a job put at the front). Every script is safe to run twice (daemon/queue/lua/_lib.lua), since
redis-py sends a command again when its reply was lost.

Over ~400 lines for a reason: this is every write the pool and its users make to the queue, each
method one script call with its arguments in the script's order; the reads live apart (reads.py),
and so do the claims (claims.py), the one call with much to say, the calls a worker makes on an
attempt it holds (attempt_calls.py), the calls of jobs held for others (held.py) and the per-user
bounds of submissions (user_room.py); dividing the writes further would split one API that
callers learn as a whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgpack
from redis.exceptions import RedisError, ResponseError

from daemon.config import Config
from daemon.errors import (
    IdempotencyConflict,
    InvalidJob,
    JobNotFound,
    TooManyUnended,
)
from daemon.job import JobSpec, JobState, Lease, new_job_id, queue_of
from daemon.queue import keys
from daemon.queue.attempt_calls import AttemptCalls
from daemon.queue.connection import AnyRedis, RunIdWatch
from daemon.queue.fast_path import Standing, StandingClaims, batch_transport, script_calls
from daemon.queue.held import HeldJobs
from daemon.queue.reads import QueueReads, _s
from daemon.queue.scripts import Command, ReplicaAck, ScriptBatch, Scripts
from daemon.queue.user_room import RECORD_BYTES, UserRoom
from daemon.queue.work_read import WorkRead
from daemon.webhook import TARGET_JOB, TARGET_POOL

log = logging.getLogger(__name__)

DEFAULT_RETENTION = 7 * 24 * 3600
DEFAULT_ACCOUNTING_DAYS = 400  # (config accounting_retention_days)
RECLAIM_BATCH = 500
ENQUEUE_CHUNK = 100  # jobs per enqueue_many script call: a few ms of Redis time at most
MAX_IDEMPOTENCY_KEY = 200
ADD_QUEUES = Command("SADD")  # name queues in the pool's queue set (`_list_queues`)
DEFAULT_LOG_MAX_BYTES = 16 * 2**20  # per job: the first quarter is kept for good, then the newest


def _stream_id(entry_id: str) -> tuple[int, int]:
    """A stream entry id ('MS-SEQ'), ordered as Redis orders them."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _job_args(spec: JobSpec, packed: bytes, notify: str) -> list[Any]:
    """What the enqueue scripts are given of one job, in the order of lib/enqueue.lua's JOB_ARGS;
    `notify`: where its end goes (JobQueue._notify_targets)."""
    return [
        packed,
        spec.gpus,
        spec.max_attempts,
        spec.retries,
        spec.priority,
        spec.user,
        spec.gpu_mem,
        " ".join(spec.after),
        spec.array,
        spec.array_pos,
        spec.array_limit if spec.array else 0,
        notify,
        0 if spec.timeout is None else round(spec.timeout * 1000),
        -1 if spec.stop_grace is None else round(spec.stop_grace * 1000),
        spec.cpus,
        spec.mem,
    ]


class JobQueue(AttemptCalls, StandingClaims, QueueReads, HeldJobs, UserRoom):
    """All queue operations of one pool, over one Redis client (a connection pool)."""

    def __init__(
        self,
        redis: AnyRedis,
        *,
        lease_seconds: float = 300.0,
        retention_seconds: int = DEFAULT_RETENTION,
        accounting_days: int = DEFAULT_ACCOUNTING_DAYS,
        log_max_bytes: int = DEFAULT_LOG_MAX_BYTES,
        watch: RunIdWatch | None = None,
        ack: ReplicaAck | None = None,
        user_caps: tuple[int, int] = (0, 0),
        fairshare: Iterable[str] = (),
        fairshare_half_life: float = 7 * 24 * 3600.0,
        preempt: Iterable[str] = (),
        retry_backoff: tuple[float, float] = (0.0, 0.0),
        notify_pool: bool = False,
        serve_user: str = "",
        max_unended: int = 0,
        max_stored: int = 0,
        fast_path: bool = True,
    ) -> None:
        """`watch` is the run-id watch of `redis`'s connections (connection.connect), for whoever
        holds leases through this queue to see when Redis restarts. `ack`: the replicas an enqueue
        and an outcome must reach before they are acknowledged (None: the primary's word).
        `user_caps`: the most jobs, and GPUs, one user may run in one queue (0: no cap), which
        this queue's claims keep to (claim.lua). `fairshare`: the queues whose claims rank users
        by recent use, which halves every `fairshare_half_life` seconds (claim.lua). `preempt`:
        the queues where a job with a priority may stop lower ones to make room (claim.lua).
        `retry_backoff`: seconds a failed job with retries left waits before it goes back to the
        front (doubled for each failure), and the most it grows to (complete.lua).
        `notify_pool`: the pool has a notify_url, so the end of every job enqueued through this
        queue is to be sent there (its record says so: to_outbox in _lib.lua). `serve_user`: the
        one pool user whose jobs this queue's claims take ("": any user's), for a worker that
        runs every job as its own user (claim.lua passes the others over).
        `max_unended`: the most jobs one user may have queued or running in one queue (0: no
        bound), which the enqueue scripts keep to (lib/finish.lua `unended`). `max_stored`: the most
        bytes of jobs one user may submit, over every queue, within one retention (0: no bound;
        lua/store.lua). `accounting_days`: how long each ended job's accounting record is kept
        (lib/account.lua; queue/accounting.py reads them). `fast_path`: the GPU-less fast path's
        switch (queue/fast_path.py; off: each script call by itself through plain redis-py, and no
        claim left standing)."""
        self.redis = redis
        self.fast_path = fast_path
        self.max_unended = max_unended
        self.max_stored = max_stored
        self.user_caps = user_caps
        self.serve_user = serve_user
        self.fairshare = frozenset(fairshare)
        self.half_life_ms = max(1, round(fairshare_half_life * 1000))
        self.preempt = frozenset(preempt)
        self.notify_pool = notify_pool
        self.ack = ack
        self.watch = watch
        self.lease_ms = max(1, round(lease_seconds * 1000))
        self.retention = retention_seconds
        self.accounting_days = accounting_days
        self.backoff_ms = tuple(max(0, round(b * 1000)) for b in retry_backoff)
        self.log_head = log_max_bytes // 4
        self.log_tail = log_max_bytes - self.log_head
        self.scripts = Scripts(redis)
        # With the fast path on, script calls made in one event-loop turn share a round trip.
        self._call = script_calls(redis, ack, watch, fast_path)
        self._transport = batch_transport(fast_path)  # how `batch()`es travel
        self._cursors: dict[str, tuple[str, str]] = {}  # queue -> (stream, wake) ids to wait after
        # Claim requests, numbered per worker (claim.lua's memo); a request whose reply never came
        # is sent again, with its number, before any new one: (queue, number) by worker.
        self._requests: dict[str, int] = {}
        self._unanswered: dict[str, tuple[str, int]] = {}
        self._stranded: dict[str, list[Lease]] = {}  # claimed by a claim_many cancelled midway
        self._standing: list[Standing] = []  # idle workers' next claims, for an enqueue to send
        # Worker -> the first of its queues whose head job its claims keep from the later ones
        # (backfill): its standing claim goes to none of those (StandingClaims.stand).
        self._head_queue: dict[str, str] = {}

    @classmethod
    def from_config(cls, redis: AnyRedis, config: Config, *, watch: RunIdWatch | None = None) -> JobQueue:
        return cls(
            redis,
            lease_seconds=config.worker_healthy_response_period,
            retention_seconds=int(config.job_retention),
            accounting_days=config.accounting_retention_days,
            log_max_bytes=config.job_log_max_bytes,
            watch=watch,
            ack=ReplicaAck.of(config.redis_min_replicas_ack, config.redis_replicas_ack_timeout),
            user_caps=(config.user_max_running_jobs, config.user_max_gpus),
            fairshare=config.fairshare_queues,
            fairshare_half_life=config.fairshare_half_life,
            preempt=config.preempt_queues,
            retry_backoff=(config.retry_backoff, config.retry_backoff_max),
            notify_pool=bool(config.notify_url),
            serve_user=config.worker_serve_user,
            max_unended=config.user_max_queued_jobs,
            max_stored=config.user_max_stored_bytes,
            fast_path=config.fast_path,
        )

    async def close(self) -> None:
        """Done with this queue while its Redis client goes on (another's view: its connection
        kept for its script calls goes back to the client's pool)."""
        await self._call.close()

    def batch(self, *, ack: bool = True) -> ScriptBatch:
        """A batch of script calls on this queue's Redis (its durable calls acknowledged as the
        queue's are, unless not `ack`), its nodes told to the queue's watch."""
        return ScriptBatch(self.redis, self.ack if ack else None, self.watch, self._transport)

    # -- submit ---------------------------------------------------------------------------------

    async def enqueue(self, spec: JobSpec, idempotency_key: str | None = None) -> tuple[str, bool]:
        """Add a job at the tail of its queue. Returns (job id, created); `created` is False when the
        idempotency key was used before by the same user (`spec.user`) in this queue for this very
        spec, and the id is then that first job's; IdempotencyConflict when it was used for
        another spec."""
        if idempotency_key is not None and not 0 < len(idempotency_key) <= MAX_IDEMPOTENCY_KEY:
            raise InvalidJob("idempotency key", f"must be 1 to {MAX_IDEMPOTENCY_KEY} characters")
        q = spec.queue
        packed = msgpack.packb(spec.to_dict())
        job_id = new_job_id(q)
        job_keys = [keys.stream(q), keys.jobs(q), keys.seq(q), keys.job(job_id)]
        if idempotency_key is not None:
            job_keys.append(keys.idempotency(q, spec.user, idempotency_key))
        stored = await self._store({spec.user: RECORD_BYTES + len(packed)})
        listed = self._list_queues([q])
        try:
            reply = self._call.submit(
                self.scripts.enqueue,
                job_keys,
                [
                    keys.GROUP,
                    keys.queue_prefix(q),
                    self.max_unended or "",
                    job_id,
                    *_job_args(spec, packed, self._notify_targets(spec)),
                ],
                durable=True,
            )
            if self._standing and not spec.held:
                self._send_standing(q, (packed, spec))  # an idle worker's claim, in the same round trip
            got, created, *conflict = await reply
        except BaseException as exc:
            await self._unlisted(listed)
            if isinstance(exc, ResponseError):  # Redis refused the script (at maxmemory): nothing written
                await self._give_back(stored)
            raise  # (its reply lost, it may have written: what _store counted stays, the safe side)
        await self._listed(listed, [q])
        if got == b"over" or not created:  # nothing written: what _store counted is given back
            await self._give_back(stored)
        if got == b"over":
            raise TooManyUnended(spec.user, q, int(created), 1, self.max_unended)
        if conflict and conflict[0]:
            assert idempotency_key is not None
            raise IdempotencyConflict(idempotency_key, _s(got))
        return _s(got), bool(created)

    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[str]:
        """Enqueue several jobs in one round trip, in order: one script call per run of up to
        ENQUEUE_CHUNK jobs of one queue, the calls pipelined. Judged whole: a batch that would take
        a user past their bytes (`max_stored`) or, in a queue, past their jobs not ended
        (`max_unended`) writes nothing (TooMuchStored, TooManyUnended). The first call of each
        queue judges all of the batch's jobs there, and a call refused makes the later calls of its
        queue refuse too (enqueue_many.lua); a batch over several queues is judged in each first,
        from their counts. Should concurrent submissions fill the room after that, what the
        calls before the refused one wrote is cancelled."""
        if not specs:
            return []
        packed = [msgpack.packb(spec.to_dict()) for spec in specs]
        chunks: list[list[int]] = []  # indices into specs
        for i, spec in enumerate(specs):
            if chunks and specs[chunks[-1][0]].queue == spec.queue and len(chunks[-1]) < ENQUEUE_CHUNK:
                chunks[-1].append(i)
            else:
                chunks.append([i])
        adding: Counter[str] = Counter()
        for spec, p in zip(specs, packed, strict=True):
            adding[spec.user] += RECORD_BYTES + len(p)
        await self._judge_queues(specs)
        stored = await self._store(adding)
        listed = self._list_queues(sorted({s.queue for s in specs}))
        batch, batch_id = self.batch(), secrets.token_hex(8)
        judged: set[str] = set()  # queues whose first call has been added
        for chunk in chunks:
            q = specs[chunk[0]].queue
            later: Counter[str] = Counter()  # jobs of the batch in q after this call, by user
            if q not in judged:  # the first call of q judges every job of the batch in q
                later = Counter(s.user for s in specs if s.queue == q) - Counter(specs[i].user for i in chunk)
                judged.add(q)
            ids = [new_job_id(q) for _ in chunk]
            args: list[Any] = [
                keys.GROUP,
                keys.queue_prefix(q),
                self.max_unended or "",
                json.dumps(dict(later)) if later else "",
            ]
            for i, job_id in zip(chunk, ids, strict=True):
                args += [job_id, *_job_args(specs[i], packed[i], self._notify_targets(specs[i]))]
            job_keys = [
                keys.batch(q, secrets.token_hex(8)),
                keys.batch_refused(q, batch_id),
                *(keys.job(job_id) for job_id in ids),
            ]
            batch.add(
                self.scripts.enqueue_many,
                [keys.stream(q), keys.jobs(q), keys.seq(q), *job_keys],
                args,
                durable=True,
            )
        try:
            replies = await batch.execute_each()
        except BaseException:
            await self._unlisted(listed)
            raise  # (replies lost, the calls may have written: what _store counted stays, the safe side)
        if errors := [reply for reply in replies if isinstance(reply, Exception)]:
            await self._unlisted(listed)
            await self._give_back_refused(specs, packed, chunks, replies, stored)
            raise errors[0]
        await self._listed(listed, sorted({s.queue for s in specs}))
        refused = [(c, reply) for c, reply in zip(chunks, replies, strict=True) if reply[0] == b"over"]
        if refused:
            await self._undo(replies, stored)
            chunk, reply = refused[0]
            q, user = specs[chunk[0]].queue, _s(reply[1])
            many = sum(s.user == user for s in specs if s.queue == q)
            raise TooManyUnended(user, q, int(reply[2]), many, self.max_unended)
        return [_s(job_id) for reply in replies for job_id in reply]

    async def _undo(self, replies: Sequence[Any], stored: Mapping[str, tuple[str, int]]) -> None:
        """Undo a refused batch: cancel what its calls not refused wrote (concurrent submissions
        filled the room after the first call of a queue judged it), or, where none wrote, give
        back the bytes `_store` counted for it."""
        written = [_s(job_id) for reply in replies if reply[0] != b"over" for job_id in reply]
        for job_id in written:
            await self.cancel(job_id, "its batch was refused: its user has too many jobs not ended")
        if not written:
            await self._give_back(stored)

    def _notify_targets(self, spec: JobSpec) -> str:
        """Where the end of a job enqueued now goes, as its record names the targets (`job`: its
        --notify URL; `pool`: notify_url), space-separated; '' for nowhere."""
        return " ".join(([TARGET_JOB] if spec.notify else []) + ([TARGET_POOL] if self.notify_pool else []))

    def _list_queues(self, queues: Sequence[str]) -> asyncio.Future[Any]:
        """Name `queues` in the pool-wide queue set (the reaper, `wait`, metrics and `ls` read it),
        in the round trip of the enqueue that follows: a SADD, safe to run twice, refused at
        maxmemory as the enqueue is. The set has a hash tag of its own, so the enqueue script
        cannot write it. Every enqueue does, so a write to the set that was lost is made good by
        the next one (no cache decides that a queue is known)."""
        return self._call.submit(ADD_QUEUES, [keys.QUEUES], list(queues))

    @staticmethod
    async def _listed(sent: asyncio.Future[Any], queues: Sequence[str]) -> None:
        """A job enqueued while its queue could not be listed stays enqueued: the next enqueue, or a
        heartbeat of a worker that serves the queue, lists it."""
        try:
            await sent
        except RedisError as exc:
            log.warning("could not name queues %s in the pool's queue set (%s)", ", ".join(queues), exc)

    @staticmethod
    async def _unlisted(sent: asyncio.Future[Any]) -> None:
        """The listing sent with an enqueue that failed: nothing was queued that needs it, and the
        enqueue's own error says what went wrong (a second warning for each refused enqueue
        doubled what one user's flood of them wrote to the log)."""
        with contextlib.suppress(RedisError):
            await sent

    # -- work -----------------------------------------------------------------------------------

    async def wait_for_work(self, queues: Sequence[str], block: float) -> list[tuple[str, str]]:
        """Block until one of `queues` gets an entry newer than what the last `claim` saw, or a job
        put at its front, or until `block` seconds pass. A blocking read, not polling. Returns
        the entries that woke it, as (stream, entry id); [] when none came. `news` tells, later,
        whether a claim has seen them since."""
        read = self.read_for_work(queues, block)
        try:
            return await read.answer()
        finally:
            await read.close()

    def read_for_work(self, queues: Sequence[str], block: float) -> WorkRead:
        """`wait_for_work`'s read, whose answer can be awaited again after a wait for it was
        cancelled (work_read.py). Sent at its first `answer()`."""
        streams: dict[str, str] = {}
        for q in queues:
            stream_cursor, wake_cursor = self._cursors.get(q, ("0-0", "0-0"))
            streams[keys.stream(q)] = stream_cursor
            streams[keys.wake(q)] = wake_cursor
        return WorkRead(self.redis, streams, block)

    def news(self, entries: Sequence[tuple[str, str]]) -> bool:
        """Whether any of `entries` (from `wait_for_work`) is newer than what this queue's claims
        have seen since they were read: an entry a later claim took, or passed over, is not. A
        read sent before a claim took the very entry it answers (a standing claim, in its enqueue's
        round trip) woke its worker for nothing new."""
        seen: dict[str, str] = {}
        for q, (stream_cursor, wake_cursor) in self._cursors.items():
            seen[keys.stream(q)], seen[keys.wake(q)] = stream_cursor, wake_cursor
        return any(_stream_id(entry_id) > _stream_id(seen.get(stream, "0-0")) for stream, entry_id in entries)

    async def primary_age(self, queues: Sequence[str]) -> float:
        """Seconds the redis-servers holding `queues` have been the pool's, as the pool knows them
        (primary_age.lua), the youngest's: 0 for one that restarted or was promoted just now, and
        when it cannot say (at maxmemory); a Redis that never held the pool's data is as old as
        time. One call per queue, in one round trip (per node, on a Cluster)."""
        batch = self.batch(ack=False)
        for q in queues:
            batch.add(self.scripts.primary_age, [keys.primary(q)], [])
        try:
            ages = await batch.execute()
        except ResponseError:  # refused at maxmemory: taken as new, the safe side
            return 0.0
        return min((int(age) / 1000 for age in ages), default=float("inf"))

    async def set_fairshare_weights(self, weights: Mapping[str, float]) -> None:
        """Give each fair-share queue these users' weights (a user's recent use is divided by
        theirs; 1 for anyone not named), replacing the weights set before (weights.lua)."""
        args = [x for user, weight in sorted(weights.items()) for x in (user, repr(float(weight)))]
        batch = self.batch()
        for q in sorted(self.fairshare):
            batch.add(self.scripts.weights, [keys.fairshare(q)], args)
        await batch.execute()

    async def requeue(self, job_id: str) -> str:
        """Ask that a running job be stopped and put back at the front of its queue, to run again
        with attempt + 1 (requeue.lua): 'requeueing', 'cancelling', or the state of a job that is
        not running ('queued', or how it ended). Raises JobNotFound."""
        q = queue_of(job_id)
        state = _s(await self._call(self.scripts.requeue, [keys.job(job_id), keys.leases(q)], []))
        if state == "missing":
            raise JobNotFound(job_id)
        if state == "requeueing":
            await self._nudge(job_id)
        return state

    async def cancel(self, job_id: str, detail: str = "") -> str:
        """Cancel a job: 'cancelled' (it was queued and will never start), 'cancelling' (it runs; its
        worker stops it), or the terminal state it already had. Raises JobNotFound. `detail`: why,
        kept in a queued job's record (the pool cancelling a job whose dependency failed)."""
        q = queue_of(job_id)
        state = _s(
            await self._call(
                self.scripts.cancel,
                [keys.stream(q), keys.front(q), keys.events(q)],
                [keys.queue_prefix(q), keys.GROUP, job_id, self.retention, detail, self.accounting_days],
            )
        )
        if state == "missing":
            raise JobNotFound(job_id)
        if state == "cancelling":
            await self._nudge(job_id)
        return state

    async def _nudge(self, job_id: str) -> None:
        """Nudge a running job's worker to renew now, so that it learns a cancel or a requeue at
        once rather than at its next heartbeat; if the nudge is lost, that heartbeat (renew
        answers CANCEL, REQUEUE) does the same."""
        worker = await self.redis.hget(keys.job(job_id), "worker")
        if worker:
            await self.redis.publish(keys.worker_channel(_s(worker)), job_id)

    async def reclaim(self, queues: Iterable[str] | None = None) -> list[tuple[str, JobState]]:
        """Take back every attempt whose lease deadline passed: its job goes to the front of its
        queue (or to cancelled / dead). Returns (job id, new state) for each. One round trip for
        all queues (a script call per queue, pipelined), more only while a queue has more than
        RECLAIM_BATCH to take."""
        out: list[tuple[str, JobState]] = []
        todo = await self.queues() if queues is None else list(queues)
        while todo:
            batch = self.batch(ack=False)
            for q in todo:
                batch.add(
                    self.scripts.reclaim,
                    [keys.stream(q), keys.front(q), keys.leases(q), keys.events(q)],
                    [keys.queue_prefix(q), keys.GROUP, RECLAIM_BATCH, self.retention, self.accounting_days],
                )
            more = []
            for q, (taken, *pairs) in zip(todo, await batch.execute(), strict=True):
                out += [(_s(pairs[i]), JobState(_s(pairs[i + 1]))) for i in range(0, len(pairs), 2)]
                if taken >= RECLAIM_BATCH:
                    more.append(q)
            todo = more
        for job_id, state in out:
            log.warning("job %s: lease expired, now %s", job_id, state)
        return out
