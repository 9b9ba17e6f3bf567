"""Claims: how a worker takes its next jobs (claim.lua), the half of JobQueue that knows the
worker's side: its free and shared GPUs, when its running jobs end (backfill), its own end (a
pilot), its numbered requests (a reply lost is asked for again, never claimed twice), and the
preemption check of a worker whose slots are all taken. `Claims` is a mixin of JobQueue, apart
because it is the one call with that much to say.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack
from redis.exceptions import RedisError

from daemon.errors import InvalidJob, NotReplicated, StaleAttempt
from daemon.job import JobSpec, JobState, Lease, Outcome
from daemon.queue import keys
from daemon.queue.failures import unanswered
from daemon.queue.reads import _s

if TYPE_CHECKING:
    from daemon.queue.connection import AnyRedis
    from daemon.queue.scripts import Calls, Scripts

log = logging.getLogger(__name__)


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


def _rooms(shared: Sequence[SharedGpu]) -> str:
    """The GPUs that can take a --gpu-mem job, as claim.lua reads them ('N:MIB:JOBS:S ...')."""
    return " ".join(f"{r.place}:{r.avail // 2**20}:{r.jobs}:{int(r.shared)}" for r in shared)


def _boottime() -> float:
    """Seconds on CLOCK_BOOTTIME, the clock a pilot's end is counted on (worker/lifetime.py)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _ahead_past(leases: list[Lease], slots: int) -> list[Lease]:
    """A claim's leases, those past the first `slots` (for slots free when it was made) marked as
    claimed ahead of a free slot, as claim.lua marked their jobs."""
    return [dataclasses.replace(lease, ahead=True) if i >= slots else lease for i, lease in enumerate(leases)]


def _opened(before: str, after: str) -> int:
    """GPUs a claim put a first shared job on: free whole in the table `before`, shared `after`."""
    was = {row.split(":")[0] for row in before.split() if row.endswith(":1")}
    return sum(1 for row in after.split() if row.endswith(":1") and row.split(":")[0] not in was)


class ClaimReply(NamedTuple):
    status: bytes  # b'claimed', b'empty', b'blocked' or b'preempting' (claim.lua)
    cursors: tuple[str, str]  # the stream ids to wait after for more (stream, wake)
    kept: int  # GPUs kept for a head job reserved on the worker
    left: str  # the shared GPUs' table as the call left it
    leases: list[Lease]


class Claims:
    """The claim calls of a JobQueue (which sets these attributes)."""

    redis: AnyRedis
    scripts: Scripts
    _call: Calls
    lease_ms: int
    user_caps: tuple[int, int]
    serve_user: str
    fairshare: frozenset[str]
    half_life_ms: int
    preempt: frozenset[str]
    _cursors: dict[str, tuple[str, str]]
    _requests: dict[str, int]
    _unanswered: dict[str, tuple[str, int]]
    _stranded: dict[str, list[Lease]]

    async def complete(self, lease: Lease, outcome: Outcome) -> JobState:
        raise NotImplementedError  # JobQueue's

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
        urgent: bool = True,
        slots: int | None = None,
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
        pilot worker has left; a job whose time limit (and stop grace) runs past it is passed over,
        and so is every job without a time limit (None: no end).

        `urgent`: a slot waits for what it claims, and its calls go ahead of the others
        (`_claim_call`). A claim made while every slot is taken (worker/fast_path.py) is not: it travels
        with the calls made in its turn (an attempt's outcome, say), one write and one wakeup of
        Redis for both, and its jobs wait for a slot anyway.

        `slots`: how many of the `count` go to slots free now (None: all). The others are claimed
        ahead of a free slot: their leases say `ahead`, and each counts as never started (a
        reclaim of it is no loss, and bills nothing) until `mark_started` says it started; none is
        taken from the front of a queue, where the claim stops instead (claim.lua)."""
        total = gpus_free if gpus_total is None else gpus_total
        rooms = _rooms(shared)
        schedule = _schedule(ends)
        kept = 0
        todo: list[tuple[str, int]] = []
        if (pending := self._unanswered.pop(worker, None)) is not None:
            todo.append(pending)
        leases: list[Lease] = []
        for q in [*[p[0] for p in todo], *queues]:
            if len(leases) >= count and not todo:
                break
            # The jobs for slots free now, of this call's: all of a request sent again (its reply
            # was lost) count as ahead, whatever it said then; a mark of one not ahead is a no-op.
            free = 0 if todo else count if slots is None else max(0, slots - len(leases))
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
                    urgent=urgent,
                    slots=free,
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
            got = _ahead_past(got, free)
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
        lifetime: float | None = None,
    ) -> bool:
        """For a worker whose slots are all taken: in each of `queues` where priorities preempt,
        should the highest-priority job waiting stop lower ones here to make room (claim.lua with
        no job wanted)? True when some were asked to. Claims nothing. `lifetime`, as claim_many's:
        a pilot stops nothing for a job it would pass over."""
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
                lifetime=lifetime,
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
        urgent: bool = True,
        slots: int | None = None,
    ) -> ClaimReply:
        """One claim.lua call; `gpus` is (free, default per job, total), `backfill` (when the
        worker's running jobs end, its stop grace in ms, GPUs it keeps for a head job). `urgent`,
        it goes ahead of the other calls (queue/fast_path.py Pipeliner): the outcome of the job whose slot it
        fills follows it. `memory`: the shared GPUs' table and the largest GPU's MiB. `slots`: how
        many of the `count` go to slots free now (None: all; claim_many)."""
        call = self._claim_request(
            worker, q, request, count, gpus, backfill=backfill, memory=memory, lifetime=lifetime, slots=slots
        )
        reply = await self._call(self.scripts.claim, *call, ahead=urgent, durable=True)
        return await self._claim_reply(worker, q, reply)

    def _claim_request(
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
        slots: int | None = None,
    ) -> tuple[list[str], list[object]]:
        """claim.lua's keys and arguments (see `_claim_call`)."""
        free, default, total = gpus
        return (
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
                count if slots is None else slots,
                self.serve_user,
            ],
        )

    async def _claim_reply(
        self, worker: str, q: str, reply: list[Any], known: tuple[bytes, JobSpec] | None = None
    ) -> ClaimReply:
        """claim.lua's answer: (status, cursors, GPUs kept for a head job, the shared GPUs' table
        as the call left it, leases). `known`: a spec at hand, packed and as the JobSpec it was
        packed from (a standing claim's enqueue's): a job whose packed spec is those very bytes
        has that JobSpec, not decoded again (a decode is dear after an idle spell)."""
        status, stream_cursor, wake_cursor, kept, left, *claimed = reply
        leases = []
        for job_id, attempt, lease_id, packed, place in (
            claimed[i : i + 5] for i in range(0, len(claimed), 5)
        ):
            try:
                if known is not None and packed == known[0]:
                    spec = known[1]
                else:
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
        return ClaimReply(status, (_s(stream_cursor), _s(wake_cursor)), int(kept), _s(left), leases)

    async def _unreadable(self, lease: Lease, exc: Exception) -> None:
        """A claimed job whose spec this worker cannot read: it fails, saying why, rather than go
        round every worker for ever (or be stranded under this one)."""
        detail = f"a worker could not read the job's spec ({exc}); was it submitted to a newer gpupool?"
        log.error("job %s: %s", lease.job_id, detail)
        try:
            await self.complete(lease, Outcome(JobState.FAILED, None, detail))
        except (RedisError, StaleAttempt, NotReplicated) as err:
            log.warning("job %s: could not record that (%s); its lease will expire", lease.job_id, err)
