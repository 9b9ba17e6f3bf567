"""The job queue on Redis Streams: enqueue, claim, renew, complete, cancel, reclaim (the reads
are reads.QueueReads, which JobQueue is too).

Every state change is one Lua script (daemon/queue/lua/, each saying what it guarantees), so a change
either happens whole or not at all, under any number of concurrent clients and workers. Keys are
named in daemon/queue/keys.py. Times stored in Redis are Redis server time in milliseconds; this module
hands out seconds (floats).

Work wakes workers without polling: `claim` returns cursors per queue, and `wait_for_work`
blocks (XREAD BLOCK) until an entry newer than them is added to the queue's stream or its `wake`
stream (a job put at the front). Every script is safe to run twice (daemon/queue/lua/_lib.lua), since
redis-py sends a command again when its reply was lost.

Over ~400 lines for a reason: this is every write the pool makes to its queue, each method one
script call with its arguments in the script's order; the reads already live apart (reads.py),
and dividing the writes further would split one API that callers learn as a whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import msgpack
from redis.commands.core import AsyncScript
from redis.exceptions import OutOfMemoryError, RedisError, ResponseError

from daemon.config import Config
from daemon.errors import InvalidJob, JobNotFound, NotReplicated, StaleAttempt
from daemon.job import JobSpec, JobState, Lease, Outcome, RenewStatus, new_job_id, queue_of
from daemon.queue import keys
from daemon.queue.connection import AnyRedis, RunIdWatch
from daemon.queue.reads import QueueReads, _s, xread
from daemon.queue.scripts import Pipeliner, ReplicaAck, ScriptBatch, Scripts, moving

log = logging.getLogger(__name__)

DEFAULT_RETENTION = 7 * 24 * 3600
RECLAIM_BATCH = 500
ENQUEUE_CHUNK = 100  # jobs per enqueue_many script call: a few ms of Redis time at most
MAX_IDEMPOTENCY_KEY = 200
DEFAULT_LOG_MAX_BYTES = 16 * 2**20  # per job: the first quarter is kept for good, then the newest


def _schedule(ends: Sequence[tuple[float | None, int]]) -> str:
    """When a worker's running jobs end at the latest, as claim.lua reads it ('MS:GPUS ...')."""
    return " ".join(f"{-1 if t is None else max(0, round(t * 1000))}:{g}" for t, g in ends if g)


class SharedGpu(NamedTuple):
    """A worker's GPU that can take a --gpu-mem job, as a claim weighs it: its place in the
    worker's list of GPUs, the bytes it has left, how many more jobs it may take, and whether
    jobs share it already (else it is free whole)."""

    place: int
    avail: int
    jobs: int
    shared: bool


def _opened(before: str, after: str) -> int:
    """GPUs a claim put a first shared job on: free whole in the table `before`, shared `after`."""
    was = {row.split(":")[0] for row in before.split() if row.endswith(":1")}
    return sum(1 for row in after.split() if row.endswith(":1") and row.split(":")[0] not in was)


def mib(nbytes: int) -> int:
    """Memory as a claim weighs it: whole MiB, rounded up (a job asking for any gets at least 1)."""
    return -(-nbytes // 2**20)


def unanswered(exc: BaseException) -> bool:
    """Whether a failed call may have run in Redis with only its reply lost: a broken connection, a
    timeout or a cancellation may hide a run, and NotReplicated says it ran (on the primary
    alone); an error Redis answered with (ResponseError, such as a refusal at maxmemory) means
    the call had no effect."""
    return not isinstance(exc, ResponseError)


def transient(exc: BaseException) -> bool:
    """Worth trying again: Redis did not answer, or answered that it cannot now (full, loading,
    busy with a script, a replica). Any other error a script answers with is its last word."""
    if not isinstance(exc, ResponseError):
        return True
    return (
        out_of_memory(exc)
        or moving(exc)  # a Redis Cluster moving a slot, or failing over
        or str(exc).startswith(("BUSY", "LOADING", "READONLY", "TRYAGAIN", "MASTERDOWN"))
    )


def out_of_memory(exc: BaseException) -> bool:
    """Redis refused a write at its maxmemory (directly, or inside a script)."""
    return isinstance(exc, OutOfMemoryError) or (isinstance(exc, ResponseError) and "OOM" in str(exc))


def _raise_if_stale(lease: Lease, reply: Sequence[Any]) -> None:
    """A fenced script's `{'stale', state, attempt}` answer: the attempt is no longer current."""
    if reply[0] == b"stale":
        raise StaleAttempt(
            lease.job_id, lease.attempt, f"the job is {_s(reply[1])} at attempt {_s(reply[2])}"
        )


class JobQueue(QueueReads):
    """All queue operations of one pool, over one Redis client (a connection pool)."""

    def __init__(
        self,
        redis: AnyRedis,
        *,
        lease_seconds: float = 300.0,
        retention_seconds: int = DEFAULT_RETENTION,
        log_max_bytes: int = DEFAULT_LOG_MAX_BYTES,
        watch: RunIdWatch | None = None,
        ack: ReplicaAck | None = None,
        user_caps: tuple[int, int] = (0, 0),
        fairshare: Iterable[str] = (),
        fairshare_half_life: float = 7 * 24 * 3600.0,
        preempt: Iterable[str] = (),
    ) -> None:
        """`watch` is the run-id watch of `redis`'s connections (connection.connect), for whoever
        holds leases through this queue to see when Redis restarts. `ack`: the replicas an enqueue
        and an outcome must reach before they are acknowledged (None: the primary's word).
        `user_caps`: the most jobs, and GPUs, one user may run in one queue (0: no cap), which
        this queue's claims keep to (claim.lua). `fairshare`: the queues whose claims rank users
        by recent use, which halves every `fairshare_half_life` seconds (claim.lua). `preempt`:
        the queues where a job with a priority may stop lower ones to make room (claim.lua)."""
        self.redis = redis
        self.user_caps = user_caps
        self.fairshare = frozenset(fairshare)
        self.half_life_ms = max(1, round(fairshare_half_life * 1000))
        self.preempt = frozenset(preempt)
        self.ack = ack
        self.watch = watch
        self.lease_ms = max(1, round(lease_seconds * 1000))
        self.retention = retention_seconds
        self.log_head = log_max_bytes // 4
        self.log_tail = log_max_bytes - self.log_head
        self.scripts = Scripts(redis)
        # Script calls made in one event-loop turn share a round trip (scripts.Pipeliner).
        self._call = Pipeliner(redis, ack, watch)
        self._cursors: dict[str, tuple[str, str]] = {}  # queue -> (stream, wake) ids to wait after
        # Claim requests, numbered per worker (claim.lua's memo); a request whose reply never came
        # is sent again, with its number, before any new one: (queue, number) by worker.
        self._requests: dict[str, int] = {}
        self._unanswered: dict[str, tuple[str, int]] = {}
        self._stranded: dict[str, list[Lease]] = {}  # claimed by a claim_many cancelled midway

    @classmethod
    def from_config(cls, redis: AnyRedis, config: Config, *, watch: RunIdWatch | None = None) -> JobQueue:
        return cls(
            redis,
            lease_seconds=config.worker_healthy_response_period,
            retention_seconds=int(config.job_retention),
            log_max_bytes=config.job_log_max_bytes,
            watch=watch,
            ack=ReplicaAck.of(config.redis_min_replicas_ack, config.redis_replicas_ack_timeout),
            user_caps=(config.user_max_running_jobs, config.user_max_gpus),
            fairshare=config.fairshare_queues,
            fairshare_half_life=config.fairshare_half_life,
            preempt=config.preempt_queues,
        )

    def batch(self, *, ack: bool = True) -> ScriptBatch:
        """A batch of script calls on this queue's Redis (its durable calls acknowledged as the
        queue's are, unless not `ack`), its nodes told to the queue's watch."""
        return ScriptBatch(self.redis, self.ack if ack else None, self.watch)

    # -- submit ---------------------------------------------------------------------------------

    async def enqueue(self, spec: JobSpec, idempotency_key: str | None = None) -> tuple[str, bool]:
        """Add a job at the tail of its queue. Returns (job id, created); `created` is False when the
        idempotency key was used before by the same user (`spec.user`), and the id is then that
        first job's."""
        if idempotency_key is not None and not 0 < len(idempotency_key) <= MAX_IDEMPOTENCY_KEY:
            raise InvalidJob("idempotency key", f"must be 1 to {MAX_IDEMPOTENCY_KEY} characters")
        q = spec.queue
        packed = msgpack.packb(spec.to_dict())
        job_id = new_job_id(q)
        job_keys = [keys.stream(q), keys.jobs(q), keys.seq(q), keys.job(job_id)]
        if idempotency_key is not None:
            job_keys.append(keys.idempotency(q, spec.user, idempotency_key))
        listed = self._list_queues([q])
        try:
            got, created = await self._call(
                self.scripts.enqueue,
                job_keys,
                [
                    keys.GROUP,
                    keys.queue_prefix(q),
                    job_id,
                    packed,
                    spec.gpus,
                    spec.max_attempts,
                    spec.retries,
                    spec.priority,
                    spec.user,
                    mib(spec.gpu_mem),
                ],
                durable=True,
            )
        finally:
            await self._listed(listed, [q])
        return _s(got), bool(created)

    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[str]:
        """Enqueue several jobs in one round trip, in order: one script call per run of up to
        ENQUEUE_CHUNK jobs of one queue, the calls pipelined."""
        chunks: list[list[JobSpec]] = []
        for spec in specs:
            if chunks and chunks[-1][0].queue == spec.queue and len(chunks[-1]) < ENQUEUE_CHUNK:
                chunks[-1].append(spec)
            else:
                chunks.append([spec])
        if not specs:
            return []
        listed = self._list_queues(sorted({s.queue for s in specs}))
        batch = self.batch()
        for chunk in chunks:
            q = chunk[0].queue
            ids = [new_job_id(q) for _ in chunk]
            args: list[Any] = [keys.GROUP, keys.queue_prefix(q)]
            for spec, job_id in zip(chunk, ids, strict=True):
                args += [job_id, msgpack.packb(spec.to_dict()), spec.gpus, spec.max_attempts, spec.retries]
                args += [spec.priority, spec.user, mib(spec.gpu_mem)]
            job_keys = [keys.batch(q, secrets.token_hex(8)), *(keys.job(job_id) for job_id in ids)]
            batch.add(
                self.scripts.enqueue_many,
                [keys.stream(q), keys.jobs(q), keys.seq(q), *job_keys],
                args,
                durable=True,
            )
        try:
            return [_s(job_id) for reply in await batch.execute() for job_id in reply]
        finally:
            await self._listed(listed, sorted({s.queue for s in specs}))

    def _list_queues(self, queues: Sequence[str]) -> asyncio.Future[Any]:
        """Name `queues` in the pool-wide queue set, in the round trip of the enqueue that follows
        (the set has a hash tag of its own, so the enqueue script cannot write it). Every enqueue
        does, so a write to the set that was lost is made good by the next one."""
        return self._call.submit(self.scripts.add_queue, [keys.QUEUES], list(queues))

    @staticmethod
    async def _listed(sent: asyncio.Future[Any], queues: Sequence[str]) -> None:
        """A job enqueued while its queue could not be listed stays enqueued: the next enqueue, or a
        heartbeat of a worker that serves the queue, lists it."""
        try:
            await sent
        except RedisError as exc:
            log.warning("could not name queues %s in the pool's queue set (%s)", ", ".join(queues), exc)

    # -- work -----------------------------------------------------------------------------------

    async def claim(
        self,
        worker: str,
        queues: Sequence[str],
        gpus_free: int = 0,
        default_gpus: int = 0,
        *,
        gpus_total: int | None = None,
    ) -> Lease | None:
        """The next job for `worker`, trying `queues` in priority order; None when none has work
        this worker can take. Never blocks: see `wait_for_work`. The GPU arguments are those of
        `claim_many`."""
        leases = await self.claim_many(worker, queues, 1, gpus_free, default_gpus, gpus_total=gpus_total)
        return leases[0] if leases else None

    async def claim_many(
        self,
        worker: str,
        queues: Sequence[str],
        count: int,
        gpus_free: int = 0,
        default_gpus: int = 0,
        *,
        gpus_total: int | None = None,
        ends: Sequence[tuple[float | None, int]] = (),
        grace: float = 0.0,
        shared: Sequence[SharedGpu] = (),
        mem_most: int = 0,
        lifetime: float | None = None,
    ) -> list[Lease]:
        """Up to `count` next jobs for `worker` (a worker with that many free slots), in queue
        priority order then each queue's order, one script call per queue tried. A job asking for
        0 GPUs needs `default_gpus` free (a worker's share per slot); a job needing more than
        `gpus_free` blocks its queue here (head of line), unless it needs more than `gpus_total`
        (the worker's GPUs in all, default `gpus_free`), which this worker could never give it: it
        is passed over. The GPUs a claimed job takes are counted out for the next. [] when none
        has work.

        Each script call is a numbered request (claim.lua): one whose reply never came (a broken
        connection, a timeout, the caller cancelled) is sent again, first, by the worker's next
        claim (or by `settle_claims`), and answers the jobs it claimed rather than stranding them.

        With replicas asked for (`ack`), a claim counts once a replica has it, as a renewal does:
        a primary cut off from its replicas (the old one, still up, after a failover elsewhere)
        grants no job and extends no lease, and a job the new primary hands to another worker is
        not running here meanwhile. One that no replica confirmed raises NotReplicated and is
        sent again, as one unanswered, until one does.

        Backfill (claim.lua): `ends` says when each job running on the worker ends at the latest,
        (seconds from now, or None for no time limit; its GPUs), and `grace` is the worker's stop
        grace: with them a queue's head job that must wait for GPUs reserves this worker, and only
        jobs that cannot delay it start here meanwhile, from its queue and those tried after it.

        GPU memory (claim.lua): `shared` lists the worker's GPUs that can take a --gpu-mem job
        (each by its place in the worker's list), `mem_most` is its largest GPU's memory (bytes);
        a lease's `shared_gpu` is the place of the GPU its job goes on. `lifetime`: the seconds a
        pilot worker has left; a job whose time limit (and stop grace) runs past it is passed over
        (None: no end)."""
        total = gpus_free if gpus_total is None else gpus_total
        rooms = " ".join(f"{r.place}:{r.avail // 2**20}:{r.jobs}:{int(r.shared)}" for r in shared)
        schedule = _schedule(ends)
        kept = 0
        todo: list[tuple[str, int]] = []
        if (pending := self._unanswered.pop(worker, None)) is not None:
            todo.append(pending)
        leases: list[Lease] = []
        for q in [*[p[0] for p in todo], *queues]:
            if len(leases) >= count and not todo:
                break
            request = todo.pop()[1] if todo else self._next_request(worker)
            try:
                status, cursors, kept, left, got = await self._claim_call(
                    worker,
                    q,
                    request,
                    count - len(leases),
                    (gpus_free, default_gpus, total),
                    backfill=(schedule, round(grace * 1000), kept),
                    memory=(rooms, mem_most // 2**20),
                    lifetime=lifetime,
                )
            except (RedisError, NotReplicated, asyncio.CancelledError) as exc:
                if unanswered(exc):
                    self._unanswered[worker] = (q, request)
                if isinstance(exc, asyncio.CancelledError):
                    self._stranded.setdefault(worker, []).extend(leases)  # for settle_claims
                if not leases or isinstance(exc, asyncio.CancelledError):
                    raise
                # Claimed jobs are this worker's now: hand them out rather than strand them.
                log.warning("claiming from queue %s failed; running the %d jobs claimed", q, len(leases))
                break
            for lease in got:
                gpus_free -= 0 if lease.spec.gpu_mem else lease.spec.gpus or default_gpus
            gpus_free -= _opened(rooms, left)  # GPUs free whole before, shared now
            rooms = left
            leases += got
            if status != b"claimed":
                self._cursors[q] = cursors
        return leases

    async def preempt_check(
        self,
        worker: str,
        queues: Sequence[str],
        gpus_free: int,
        default_gpus: int,
        *,
        gpus_total: int,
        ends: Sequence[tuple[float | None, int]] = (),
        grace: float = 0.0,
    ) -> bool:
        """For a worker whose slots are all taken: in each of `queues` where priorities preempt,
        should the highest-priority job waiting stop lower ones here to make room (claim.lua with
        no job wanted)? True when some were asked to. Claims nothing."""
        schedule = _schedule(ends)
        asked = False
        for q in [q for q in queues if q in self.preempt]:
            status, cursors, _, _, _ = await self._claim_call(
                worker,
                q,
                self._next_request(worker),
                0,
                (gpus_free, default_gpus, gpus_total),
                backfill=(schedule, round(grace * 1000), 0),
            )
            self._cursors[q] = cursors
            asked = asked or status == b"preempting"
        return asked

    async def settle_claims(self, worker: str) -> list[Lease]:
        """The jobs of `worker`'s claims that it never got: those of a request whose reply never
        came (sent again asking for nothing, it answers what its first run claimed, or, if it
        never ran, makes sure it never will: a later copy claims nothing), and those claimed from
        other queues by a `claim_many` cancelled before it returned. A worker that stops calls
        this, to hand such jobs back at once."""
        leases = self._stranded.pop(worker, [])
        pending = self._unanswered.pop(worker, None)
        if pending is None:
            return leases
        q, request = pending
        try:
            _, _, _, _, got = await self._claim_call(worker, q, request, 0, (0, 0, 0))
        except (RedisError, NotReplicated, asyncio.CancelledError) as exc:
            if unanswered(exc):
                self._unanswered[worker] = pending
            self._stranded.setdefault(worker, []).extend(leases)
            raise
        return leases + got

    def _next_request(self, worker: str) -> int:
        self._requests[worker] = number = self._requests.get(worker, 0) + 1
        return number

    async def _claim_call(
        self,
        worker: str,
        q: str,
        request: int,
        count: int,
        gpus: tuple[int, int, int],
        *,
        backfill: tuple[str, int, int] = ("", 0, 0),
        memory: tuple[str, int] = ("", 0),
        lifetime: float | None = None,
    ) -> tuple[bytes, tuple[str, str], int, str, list[Lease]]:
        """One claim.lua call; `gpus` is (free, default per job, total), `backfill` (when the
        worker's running jobs end, its stop grace in ms, GPUs it keeps for a head job). It goes
        ahead of the other calls (scripts.Pipeliner): the outcome of the job whose slot it fills
        follows it. `memory`: the shared GPUs' table and the largest GPU's MiB. Returns (status,
        cursors, GPUs kept for a head job, the shared GPUs' table as the call left it, leases)."""
        free, default, total = gpus
        status, stream_cursor, wake_cursor, kept, left, *claimed = await self._call(
            self.scripts.claim,
            [keys.stream(q), keys.retry(q), keys.leases(q), keys.claims(q, worker), keys.parked(q)],
            [
                keys.queue_prefix(q),
                keys.GROUP,
                worker,
                free,
                self.lease_ms,
                default,
                count,
                total,
                request,
                *self.user_caps,
                self.half_life_ms if q in self.fairshare else 0,
                *backfill,
                1 if q in self.preempt else 0,
                *memory,
                0 if lifetime is None else max(1, round(lifetime * 1000)),
            ],
            ahead=True,
            durable=True,
        )
        leases = []
        for job_id, attempt, lease_id, packed, place in (
            claimed[i : i + 5] for i in range(0, len(claimed), 5)
        ):
            try:
                spec = JobSpec.from_dict(msgpack.unpackb(packed))
            except (InvalidJob, ValueError) as exc:  # a spec from a newer gpupool, say
                await self._unreadable(
                    Lease(_s(job_id), int(attempt), worker, JobSpec(("?",), q), _s(lease_id)), exc
                )
                continue
            leases.append(Lease(_s(job_id), int(attempt), worker, spec, _s(lease_id), int(place)))
        if status == b"preempting":  # the worker's jobs asked to make room: it hears at its next beat,
            with contextlib.suppress(RedisError):  # or now (best effort: the leases are what count)
                await self.redis.publish(keys.worker_channel(worker), q)
        return status, (_s(stream_cursor), _s(wake_cursor)), int(kept), _s(left), leases

    async def _unreadable(self, lease: Lease, exc: Exception) -> None:
        """A claimed job whose spec this worker cannot read: it fails, saying why, rather than go
        round every worker for ever (or be stranded under this one)."""
        detail = f"a worker could not read the job's spec ({exc}); was it submitted to a newer gpupool?"
        log.error("job %s: %s", lease.job_id, detail)
        try:
            await self.complete(lease, Outcome(JobState.FAILED, None, detail))
        except (RedisError, StaleAttempt, NotReplicated) as err:
            log.warning("job %s: could not record that (%s); its lease will expire", lease.job_id, err)

    async def wait_for_work(self, queues: Sequence[str], block: float) -> bool:
        """Block until one of `queues` gets an entry newer than what the last `claim` saw, or a job
        put at its front, or until `block` seconds pass. True when woken by an entry. A blocking
        read, not polling."""
        streams: dict[str, str] = {}
        for q in queues:
            stream_cursor, wake_cursor = self._cursors.get(q, ("0-0", "0-0"))
            streams[keys.stream(q)] = stream_cursor
            streams[keys.wake(q)] = wake_cursor
        return bool(await xread(self.redis, streams, count=1, block=block))

    async def renew(self, worker: str, leases: Iterable[Lease]) -> dict[str, RenewStatus]:
        """Extend all of a worker's leases in one round trip (one script call per queue, pipelined).
        The answers are keyed by lease id. A lease that was reclaimed answers LOST and is not
        taken back."""
        batch = self.batch(ack=False)
        answers = self.add_renewals(batch, worker, leases)
        return answers(await batch.execute())

    def add_renewals(
        self, batch: ScriptBatch, worker: str, leases: Iterable[Lease]
    ) -> Callable[[Sequence[Any]], dict[str, RenewStatus]]:
        """Add the renewals of `renew` to `batch` (so a heartbeat can send them in the same round
        trip as other calls); returns the function that reads their answers, by lease id, from the
        batch's replies once it has run. Answers are keyed by lease, never by job: an answer
        for one attempt can never be taken for another attempt of the same job."""
        by_queue: dict[str, list[Lease]] = {}
        for lease in leases:
            by_queue.setdefault(lease.queue, []).append(lease)
        calls: list[tuple[int, list[Lease]]] = []
        for q, held in by_queue.items():
            args: list[Any] = [keys.queue_prefix(q), worker, self.lease_ms]
            for lease in held:
                args += [lease.job_id, lease.attempt, lease.id]
            # durable: a lease is held only as far as a replica has its renewal (see `claim_many`)
            calls.append((batch.add(self.scripts.renew, [keys.leases(q)], args, durable=True), held))

        def answers(replies: Sequence[Any]) -> dict[str, RenewStatus]:
            out: dict[str, RenewStatus] = {}
            for index, held in calls:
                for lease, answer in zip(held, replies[index], strict=True):
                    out[lease.id] = RenewStatus(_s(answer))
            return out

        return answers

    async def complete(self, lease: Lease, outcome: Outcome) -> JobState:
        """Record how an attempt ended. Returns the job's state afterwards (QUEUED when a failed job
        goes back for a retry). Raises StaleAttempt, changing nothing, when `lease` is no longer the
        job's current one (it was reclaimed, or ended otherwise). The same call made again (its
        reply was lost) answers as the first did."""
        q = lease.queue
        return await self._end_attempt(
            self.scripts.complete,
            lease,
            [keys.stream(q), keys.leases(q), keys.events(q), keys.retry(q)],
            str(outcome.state),
            "" if outcome.exit_code is None else outcome.exit_code,
            outcome.detail,
            msgpack.packb(dict(outcome.result)),
            self.retention,
            durable=True,
        )

    async def release(self, lease: Lease) -> JobState:
        """Hand an attempt back that this worker stopped before its job finished (a drain): the job
        goes to the front of its queue and is claimed next with attempt+1; a hand-back does not
        count towards max_attempts. Returns QUEUED, or CANCELLED when the user cancelled it
        meanwhile. Raises StaleAttempt, changing nothing, when `lease` is no longer current."""
        q = lease.queue
        return await self._end_attempt(
            self.scripts.release,
            lease,
            [keys.stream(q), keys.retry(q), keys.leases(q), keys.events(q)],
            self.retention,
        )

    async def _end_attempt(
        self, script: AsyncScript, lease: Lease, job_keys: list[str], *args: Any, durable: bool = False
    ) -> JobState:
        """Run a script that ends `lease`'s attempt (complete.lua, release.lua), fenced by the lease:
        the job's state afterwards, or StaleAttempt when the lease is no longer current. `durable`:
        acknowledged once on the replicas asked for (an outcome; a hand-back need not be: lost
        with a primary, the attempt's lease expires and the job runs again)."""
        reply = await self._call(
            script,
            job_keys,
            [
                keys.queue_prefix(lease.queue),
                keys.GROUP,
                lease.worker,
                lease.job_id,
                lease.attempt,
                lease.id,
                *args,
            ],
            durable=durable,
        )
        _raise_if_stale(lease, reply)
        return JobState(_s(reply[0]))

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

    async def cancel(self, job_id: str) -> str:
        """Cancel a job: 'cancelled' (it was queued and will never start), 'cancelling' (it runs; its
        worker stops it), or the terminal state it already had. Raises JobNotFound."""
        q = queue_of(job_id)
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
                    [keys.stream(q), keys.retry(q), keys.leases(q), keys.events(q)],
                    [keys.queue_prefix(q), keys.GROUP, RECLAIM_BATCH, self.retention],
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

    async def append_log(self, lease: Lease, number: int, chunks: Sequence[bytes]) -> None:
        """Append output of an attempt to its job's log, as the attempt's call `number` (1, 2, ...:
        a call sent again with its number is written once). Raises StaleAttempt, writing nothing,
        when the attempt is no longer current."""
        answer = await self._call(
            self.scripts.log,
            [keys.job(lease.job_id), keys.log(lease.job_id)],
            [lease.worker, lease.attempt, lease.id, number, self.log_head, self.log_tail, *chunks],
        )
        if answer == b"stale":
            raise StaleAttempt(lease.job_id, lease.attempt, "its log is closed to it")
