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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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


class SharedGpu(NamedTuple):
    """A worker's GPU that can take a --gpu-mem job, as a claim weighs it: its place in the
    worker's list of GPUs, the bytes it has left, how many more jobs it may take, whether jobs
    share it already (else it is free whole), and its bytes in all, by which a job on it is
    charged its share of a GPU (accounting; 0: not said, as by a worker of before, and the job is
    charged a whole GPU)."""

    place: int
    avail: int
    jobs: int
    shared: bool
    memory: int = 0


@dataclass(frozen=True)
class Capacity:
    """What a worker can take now, as a claim weighs it, described once (in GPUs, bytes and
    seconds): the GPUs it has free whole, what a job asking for none gets (a slot's share), its
    GPUs in all (None: as many as are free), when its running jobs end at the latest (seconds from
    now, None for no time limit; their GPUs: backfill), its stop grace, the GPUs that can take a
    --gpu-mem job and its largest GPU's bytes (packing), the seconds a pilot has left (None:
    no end; a job whose time limit and stop grace run past it is passed over, and so is every job
    without a time limit), and its CPUs and bytes of memory for jobs, free and in all (claim/host.lua;
    totals of 0: not counted, every job fits them), with when the running jobs holding some end at
    the latest (`host_ends`: seconds or None, CPUs, bytes), for backfill as `ends` are."""

    gpus_free: int = 0
    slot_gpus: int = 0
    gpus_total: int | None = None
    ends: Sequence[tuple[float | None, int]] = ()
    grace: float = 0.0
    shared: Sequence[SharedGpu] = ()
    largest_gpu: int = 0
    lifetime: float | None = None
    cpus_free: int = 0
    cpus_total: int = 0
    mem_free: int = 0
    mem_total: int = 0
    host_ends: Sequence[tuple[float | None, int, int]] = ()

    @property
    def total(self) -> int:
        return self.gpus_free if self.gpus_total is None else self.gpus_total

    def after(self, reply: ClaimReply) -> Capacity:
        """What is left for the next queue's claim once `reply`'s jobs are counted out."""
        return dataclasses.replace(
            self,
            gpus_free=reply.gpus_free,
            shared=reply.shared,
            gpus_total=self.total,
            cpus_free=reply.cpus_free,
            mem_free=reply.mem_free,
        )


class HeadNeed(NamedTuple):
    """What a head job reserved on a worker needs there (claim/backfill.lua): its GPUs, CPUs and
    bytes of memory. A claim keeps it from the worker's later queues in the same round: a job
    there starts only if it ends before the head could have all of it."""

    gpus: int
    cpus: int
    mem: int


@dataclass(frozen=True)
class ClaimRequest:
    """One claim.lua call: `count` jobs of `queue` for `worker` (its request number `request`; a
    request sent again answers the same leases), of which `slots` go to slots free now (the others
    are claimed ahead of a free slot), on `capacity`, with `kept` what a head job reserved on the
    worker in a queue it claimed from before this one needs (None: no such head). `policy` is the
    queue's: its caps per user, fair share's half-life, whether priorities preempt, the one user
    the worker serves and the lease length. Packed once, as one msgpack map that
    claim/request.lua unpacks once."""

    worker: str
    queue: str
    request: int
    count: int
    slots: int
    capacity: Capacity
    policy: Mapping[str, object]
    kept: HeadNeed | None = None

    def keys(self) -> list[str]:
        q = self.queue
        return [keys.stream(q), keys.front(q), keys.leases(q), keys.claims(q, self.worker), keys.parked(q)]

    def packed(self) -> bytes:
        room = self.capacity
        packed: bytes = msgpack.packb(
            {
                "prefix": keys.queue_prefix(self.queue),
                "group": keys.GROUP,
                "worker": self.worker,
                "request": self.request,
                "count": self.count,
                "slots": self.slots,
                "gpus_free": room.gpus_free,
                "gpus_total": room.total,
                "slot_gpus": room.slot_gpus,
                "shared": [list(g) for g in room.shared],
                "largest_gpu": room.largest_gpu,
                "ends": [
                    *([_ms(t), g, 0, 0] for t, g in room.ends if g),
                    *([_ms(t), 0, c, m] for t, c, m in room.host_ends if c or m),
                ],
                "grace_ms": round(room.grace * 1000),
                "lifetime_ms": 0 if room.lifetime is None else max(1, round(room.lifetime * 1000)),
                "kept": [] if self.kept is None else list(self.kept),
                "cpus_free": room.cpus_free,
                "cpus_total": room.cpus_total,
                "mem_free": room.mem_free,
                "mem_total": room.mem_total,
                **self.policy,
            }
        )
        return packed


REPLY_HEAD = 8  # the fields of claim.lua's reply before its leases (ClaimReply's, less `leases`)


@dataclass(frozen=True)
class ClaimReply:
    """claim.lua's answer (claim/ledger.lua `reply`): why claiming stopped (b'claimed', b'empty',
    b'blocked' or b'preempting'), the stream ids to wait after for more (stream, wake), what a
    head job reserved on the worker needs kept there (None: none), what the call left of the
    worker's GPUs (free whole, and the shared GPUs' table), CPUs and memory, and the leases."""

    status: bytes
    cursors: tuple[str, str]
    kept: HeadNeed | None
    gpus_free: int
    shared: tuple[SharedGpu, ...]
    leases: list[Lease]
    cpus_free: int = 0
    mem_free: int = 0


def _ms(seconds: float | None) -> int:
    """An end in ms from now as claim/backfill.lua reads it (-1: no time limit)."""
    return -1 if seconds is None else max(0, round(seconds * 1000))


def _boottime() -> float:
    """Seconds on CLOCK_BOOTTIME, the clock a pilot's end is counted on (worker/lifetime.py)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _ahead_past(leases: list[Lease], slots: int) -> list[Lease]:
    """A claim's leases, those past the first `slots` (for slots free when it was made) marked as
    claimed ahead of a free slot, as claim.lua marked their jobs."""
    return [dataclasses.replace(lease, ahead=True) if i >= slots else lease for i, lease in enumerate(leases)]


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
    _head_queue: dict[str, str]

    async def complete(self, lease: Lease, outcome: Outcome) -> JobState:
        raise NotImplementedError  # JobQueue's

    async def claim(
        self, worker: str, queues: Sequence[str], capacity: Capacity | None = None
    ) -> Lease | None:
        """The next job for `worker`, trying `queues` in priority order; None when none has work
        this worker can take. Never blocks: see `wait_for_work`."""
        leases = await self.claim_many(worker, queues, 1, capacity)
        return leases[0] if leases else None

    async def claim_many(
        self,
        worker: str,
        queues: Sequence[str],
        count: int,
        capacity: Capacity | None = None,
        *,
        urgent: bool = True,
        slots: int | None = None,
    ) -> list[Lease]:
        """Up to `count` next jobs for `worker` (a worker with that many free slots and
        `capacity`), in queue priority order then each queue's order, one script call per queue
        tried (claim.lua: what a job needs, and which waits, is its parts' to say). The GPUs a
        claimed job takes are counted out for the next queue's call, and what a head job reserved
        on the worker needs is kept from it (backfill: its GPUs, CPUs and memory). [] when none
        has work.

        Each script call is a numbered request (claim.lua): one whose reply never came (a broken
        connection, a timeout, the caller cancelled) is sent again, first, by the worker's next
        claim (or by `settle_claims`), and answers the jobs it claimed rather than stranding them.

        With replicas asked for (`ack`), a claim counts once a replica has it, as a renewal does:
        a primary cut off from its replicas (the old one, still up, after a failover elsewhere)
        grants no job and extends no lease, and a job the new primary hands to another worker is
        not running here meanwhile. One that no replica confirmed raises NotReplicated and is
        sent again, as one unanswered, until one does.

        `urgent`: a slot waits for what it claims, and its calls go ahead of the others
        (`_claim_call`). A claim made while every slot is taken (worker/fast_path.py) is not: it travels
        with the calls made in its turn (an attempt's outcome, say), one write and one wakeup of
        Redis for both, and its jobs wait for a slot anyway.

        `slots`: how many of the `count` go to slots free now (None: all). The others are claimed
        ahead of a free slot: their leases say `ahead`, and each counts as never started (a
        reclaim of it is no loss, and bills nothing) until `mark_started` says it started; none is
        taken from the front of a queue, where the claim stops instead (claim.lua)."""
        room = capacity or Capacity()
        kept: HeadNeed | None = None
        todo: list[tuple[str, int]] = []
        if (pending := self._unanswered.pop(worker, None)) is not None:
            todo.append(pending)
        leases: list[Lease] = []
        self._head_queue.pop(worker, None)  # this round finds afresh where a head is kept
        for q in [*[p[0] for p in todo], *queues]:
            if len(leases) >= count and not todo:
                break
            # The jobs for slots free now, of this call's: all of a request sent again (its reply
            # was lost) count as ahead, whatever it said then; a mark of one not ahead is a no-op.
            free = 0 if todo else count if slots is None else max(0, slots - len(leases))
            request = todo.pop()[1] if todo else self._next_request(worker)
            try:
                got = await self._claim_call(
                    self._request(worker, q, request, count - len(leases), room, slots=free, kept=kept),
                    urgent=urgent,
                )
            except (RedisError, NotReplicated, asyncio.CancelledError) as exc:
                if unanswered(exc):
                    self._unanswered[worker] = (q, request)
                self._head_queue.setdefault(worker, q)  # what it keeps is unknown: none stands after it
                if isinstance(exc, asyncio.CancelledError):
                    self._stranded.setdefault(worker, []).extend(leases)  # for settle_claims
                if not leases or isinstance(exc, asyncio.CancelledError):
                    raise
                # Claimed jobs are this worker's now: hand them out rather than strand them.
                log.warning("claiming from queue %s failed; running the %d jobs claimed", q, len(leases))
                break
            room, kept = room.after(got), got.kept
            if kept is not None:
                self._head_queue.setdefault(worker, q)
            leases += _ahead_past(got.leases, free)
            if got.status != b"claimed":
                self._cursors[q] = got.cursors
        return leases

    async def preempt_check(self, worker: str, queues: Sequence[str], capacity: Capacity) -> bool:
        """For a worker whose slots are all taken: in each of `queues` where priorities preempt,
        should the highest-priority job waiting stop lower ones here to make room (claim.lua with
        no job wanted)? True when some were asked to. Claims nothing. A pilot (`lifetime`) stops
        nothing for a job it would pass over."""
        asked = False
        for q in [q for q in queues if q in self.preempt]:
            got = await self._claim_call(self._request(worker, q, self._next_request(worker), 0, capacity))
            self._cursors[q] = got.cursors
            asked = asked or got.status == b"preempting"
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
            got = await self._claim_call(self._request(worker, q, request, 0, Capacity()))
        except (RedisError, NotReplicated, asyncio.CancelledError) as exc:
            if unanswered(exc):
                self._unanswered[worker] = pending
            self._stranded.setdefault(worker, []).extend(leases)
            raise
        return leases + got.leases

    def _next_request(self, worker: str) -> int:
        self._requests[worker] = number = self._requests.get(worker, 0) + 1
        return number

    def _request(
        self,
        worker: str,
        q: str,
        request: int,
        count: int,
        capacity: Capacity,
        *,
        slots: int | None = None,
        kept: HeadNeed | None = None,
    ) -> ClaimRequest:
        """A claim request of `worker`'s in queue `q`, under this queue's policy there."""
        policy: Mapping[str, object] = {
            "lease_ms": self.lease_ms,
            "max_jobs": self.user_caps[0],
            "max_gpus": self.user_caps[1],
            "half_life_ms": self.half_life_ms if q in self.fairshare else 0,
            "preempt": q in self.preempt,
            "serves": self.serve_user,
        }
        return ClaimRequest(
            worker, q, request, count, count if slots is None else slots, capacity, policy, kept
        )

    async def _claim_call(self, claim: ClaimRequest, *, urgent: bool = True) -> ClaimReply:
        """One claim.lua call. `urgent`, it goes ahead of the other calls (queue/fast_path.py Pipeliner): the
        outcome of the job whose slot it fills follows it."""
        reply = await self._call(
            self.scripts.claim, claim.keys(), [claim.packed()], ahead=urgent, durable=True
        )
        return await self._claim_reply(claim.worker, claim.queue, reply)

    async def _claim_reply(
        self, worker: str, q: str, reply: list[Any], known: tuple[bytes, JobSpec] | None = None
    ) -> ClaimReply:
        """claim.lua's answer, read (ClaimReply). `known`: a spec at hand, packed and as the
        JobSpec it was packed from (a standing claim's enqueue's): a job whose packed spec is those
        very bytes has that JobSpec, not decoded again (a decode is dear after an idle spell)."""
        head, claimed = reply[:REPLY_HEAD], reply[REPLY_HEAD:]
        status, stream_cursor, wake_cursor, kept, gpus_free, shared, cpus_free, mem_free = head
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
        table = tuple(
            SharedGpu(int(p), int(left), int(n), bool(int(sh)), int(memory))
            for p, left, n, sh, memory in shared
        )
        return ClaimReply(
            status,
            (_s(stream_cursor), _s(wake_cursor)),
            HeadNeed(int(kept[0]), int(kept[1]), int(kept[2])) if kept else None,
            int(gpus_free),
            table,
            leases,
            int(cpus_free),
            int(mem_free),
        )

    async def _unreadable(self, lease: Lease, exc: Exception) -> None:
        """A claimed job whose spec this worker cannot read: it fails, saying why, rather than go
        round every worker for ever (or be stranded under this one)."""
        detail = f"a worker could not read the job's spec ({exc}); was it submitted to a newer gpupool?"
        log.error("job %s: %s", lease.job_id, detail)
        try:
            await self.complete(lease, Outcome(JobState.FAILED, None, detail))
        except (RedisError, StaleAttempt, NotReplicated) as err:
            log.warning("job %s: could not record that (%s); its lease will expire", lease.job_id, err)
