"""Admission: whether a job may be queued, and queuing it. Every check a submission passes is
here, each for the whole batch before any of it is queued: its spec (JobSpec.from_dict, the user
set from the connection), its size (bounds.py), Redis's room, its priority against its user's
ceiling, its --notify URL, a worker that fits it, the data it names being its user's, and the jobs
it waits for being in the pool. Once queued, what waits for other jobs is noted where they find it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

from redis.exceptions import RedisError

from daemon.errors import (
    GpupoolError,
    InvalidJob,
    JobNotFound,
    NotReplicated,
    NoWorkerFits,
    NoWorkerServes,
    PriorityTooHigh,
)
from daemon.job import JobSpec
from daemon.metrics.server import ServerMetrics
from daemon.queue.job_queue import JobQueue
from daemon.queue.registry import registered_workers
from daemon.server import worker_fit
from daemon.server.bounds import SubmitBounds
from daemon.server.data_desk import DataDesk, data_of
from daemon.server.dependencies import judge_held
from daemon.server.queue_defaults import QueueDefaults
from daemon.server.redis_room import RedisRoom
from daemon.webhook_targets import Allowed
from protocol import Enqueued, EnqueuedBatch, ErrorCode

log = logging.getLogger(__name__)

MAX_BATCH = 10_000


class Admission:
    """What a user may queue, by the pool's policy; `enqueue` and `enqueue_batch` queue it.
    `admins` may use any priority and any data; `max_priority` per user, else
    `default_max_priority`; `notify_allowed` the addresses a --notify URL may name (config
    notify_allow; webhook_targets.py); `bounds` how large a spec may be (bounds.py). The server's
    reload (service.py) sets these anew."""

    def __init__(
        self,
        queue: JobQueue,
        data: DataDesk | None,
        metrics: ServerMetrics | None,
        *,
        admins: frozenset[str],
        max_priority: Mapping[str, int] | None,
        default_max_priority: int,
        notify_allowed: Allowed | None,
        bounds: SubmitBounds | None,
    ) -> None:
        self.queue = queue
        self.data = data
        self.metrics = metrics
        self.admins = admins
        self.max_priority = dict(max_priority or {})
        self.default_max_priority = default_max_priority
        self.notify_allowed = notify_allowed or Allowed()
        self.bounds = bounds or SubmitBounds()
        self.defaults = QueueDefaults()  # the queues' CPUs and memory, set by service.py from the config
        self.room = RedisRoom(queue.redis)  # new jobs refused before Redis is full

    async def enqueue(self, spec: dict[str, Any], key: str | None, user: str) -> Enqueued:
        workers = await registered_workers(self.queue.redis)  # what they serve, not what runs
        job_spec = self._resources(spec_of(spec, user), workers)
        self.bounds.check(job_spec)
        await self.room.check()
        self._check_priority([job_spec], user)
        self._check_notify([job_spec])
        self._check_fits([job_spec], workers)
        await self._check_data([job_spec], user)
        await self._check_after([job_spec])
        job_id, created = await self.queue.enqueue(job_spec, key)
        await self._wait_for_others([(job_id, job_spec)])
        if created and self.metrics is not None:
            self.metrics.job_enqueued(job_spec.queue)
        return Enqueued(job_id, created)

    async def enqueue_batch(self, specs: list[dict[str, Any]], user: str) -> EnqueuedBatch:
        if len(specs) > MAX_BATCH:
            raise GpupoolError(
                f"a batch holds at most {MAX_BATCH} jobs, not {len(specs)}: send them in several",
                ErrorCode.INVALID_ARGUMENT,
            )
        workers = await registered_workers(self.queue.redis)
        job_specs = [self._resources(spec_of(s, user), workers) for s in specs]
        for job_spec in job_specs:
            self.bounds.check(job_spec)
        await self.room.check()
        self._check_priority(job_specs, user)
        self._check_notify(job_specs)
        self._check_fits(job_specs, workers)
        await self._check_data(job_specs, user)
        await self._check_after(job_specs)
        ids = await self.queue.enqueue_many(job_specs)
        await self._wait_for_others(list(zip(ids, job_specs, strict=True)))
        if self.metrics is not None:
            for q, count in Counter(s.queue for s in job_specs).items():
                self.metrics.job_enqueued(q, count)
        return EnqueuedBatch(ids)

    def _check_notify(self, specs: list[JobSpec]) -> None:
        """Every --notify URL that names an address names one the pool notifies (a name is judged
        at delivery, by each address it resolves to: server/notify_resolver.py)."""
        for spec in specs:
            if spec.notify and (why := self.notify_allowed.url_refusal(spec.notify)):
                raise InvalidJob(
                    "notify",
                    f"{spec.notify!r}: {why}, which this pool does not notify; only public addresses "
                    "are, and those the pool's operator lists in notify_allow",
                )

    async def _check_after(self, specs: list[JobSpec]) -> None:
        """Every job a spec waits for (--after) is in the pool (the whole batch: nothing is queued)."""
        for dep in {d.rpartition(":")[0] for s in specs for d in s.after}:
            try:
                await self.queue.get(dep)
            except JobNotFound:
                raise GpupoolError(
                    f"--after {dep}: no such job in the pool (or it ended longer ago than the pool "
                    "keeps jobs)",
                    ErrorCode.INVALID_ARGUMENT,
                ) from None

    async def _wait_for_others(self, jobs: list[tuple[str, JobSpec]]) -> None:
        """Jobs queued to wait for others (held out of their queue, daemon/after.py): each is noted
        where the jobs it waits for will find it when they end, then judged once (they may have
        ended already; server/dependencies.py). What each waits for, and its array's window, the
        enqueue wrote itself: a server that dies before this leaves them to the next sweep."""
        waits = [(job_id, spec.after) for job_id, spec in jobs if spec.after]
        if not waits:
            return
        try:
            await self.queue.note_dependents(waits)
            await judge_held(self.queue, waits)
        except (RedisError, NotReplicated) as exc:  # queued all the same: the sweep judges them
            log.warning(
                "could not note or judge %d job(s) waiting for others now (%s): the sweep will",
                len(waits),
                exc,
            )

    def _check_priority(self, specs: list[JobSpec], user: str) -> None:
        """Refuse a priority above `user`'s ceiling (the whole batch: nothing is queued)."""
        asked = max((s.priority for s in specs), default=0)
        if asked and user not in self.admins:
            ceiling = self.max_priority.get(user, self.default_max_priority)
            if asked > ceiling:
                raise PriorityTooHigh(asked, ceiling)

    async def _check_data(self, specs: list[JobSpec], user: str) -> None:
        """Every input, snapshot and project pack is data `user` uploaded (admins' jobs may take
        any)."""
        if self.data is None or user in self.admins:
            return
        seen: set[tuple[str, ...]] = set()
        for spec in specs:  # a batch shares its data, mostly: each set of it checked once
            shas = data_of(spec)
            if shas and shas not in seen:
                seen.add(shas)
                await self.data.check_inputs(spec, user)

    def _resources(self, spec: JobSpec, workers: list[dict[str, Any]]) -> JobSpec:
        """`spec` with its queue's CPUs and memory where it asks for none. Not while a worker of
        before issue 50 serves its queue (in a rolling upgrade: its registration has no
        `job_memory`): such a worker refuses a spec with `cpus` or `mem`, and would fail the job;
        there no default is filled in, and a job that asks is refused, saying why."""
        older = sorted(
            str(w.get("id"))
            for w in workers
            if spec.queue in (w.get("queues") or ()) and "job_memory" not in w
        )
        if not older:
            return self.defaults.applied(spec)
        if spec.cpus or spec.mem:
            raise InvalidJob(
                "cpus" if spec.cpus else "mem",
                f"cannot be given in queue {spec.queue!r} yet: its worker(s) {', '.join(older[:3])} "
                "are of a gpupool before CPUs and memory were resources and would fail the job; "
                "upgrade the queue's workers first (docs/OPERATIONS.md, upgrades)",
            )
        return spec

    def _check_fits(self, specs: list[JobSpec], workers: list[dict[str, Any]]) -> None:
        """Refuse a job for a queue that no registered worker serves, or that asks for more GPUs
        than every registered worker serving its queue has, or CPUs, memory and GPUs that no one
        of them has together (dead ones included: they may come back), unless it asks to wait for
        such a worker: it would never start (queued anyway, workers pass it over: claim.lua). A
        pool that no worker has joined yet (a server started before its workers) takes a job for
        any queue, and refuses only a GPU job."""
        checked = [s for s in specs if not s.wait_for_worker]
        if not checked:
            return
        served = {q for w in workers for q in w.get("queues") or ()}
        for spec in checked:
            if workers and spec.queue not in served:
                raise NoWorkerServes(spec.queue, sorted(served))
            serving = [w for w in workers if spec.queue in w.get("queues", ())]
            _check_gpus_fit(spec, serving)
            if workers and (spec.cpus or spec.mem):
                _check_host_fits(spec, serving)


def spec_of(data: dict[str, Any], user: str) -> JobSpec:
    """The spec a user sent, validated, its user the connection's."""
    if "user" in data:
        raise InvalidJob("user", "is set by the server from the authenticated connection; leave it out")
    return JobSpec.from_dict({**data, "user": user})


def _check_gpus_fit(spec: JobSpec, serving: list[dict[str, Any]]) -> None:
    """Refuse a job asking for more GPUs, or more memory on one GPU, than any of the `serving`
    workers has."""
    if spec.gpu_mem:  # memory on one GPU: the largest GPU of any worker serving the queue
        most = max((int(g.get("memory", 0)) for w in serving for g in w.get("gpus", ())), default=None)
        if spec.gpu_mem > (most or 0):
            has = None if most is None else f"a GPU of {most / 2**30:.1f} GiB at most"
            raise NoWorkerFits(f"{spec.gpu_mem / 2**30:.1f} GiB on one GPU", spec.queue, has)
    elif spec.gpus:
        largest = max((len(w.get("gpus", ())) for w in serving), default=None)
        if spec.gpus > (largest or 0):
            needs = f"{spec.gpus} GPU{'s' if spec.gpus != 1 else ''}"
            raise NoWorkerFits(needs, spec.queue, None if largest is None else str(largest))


def _check_host_fits(spec: JobSpec, serving: list[dict[str, Any]]) -> None:
    """Refuse a job that no one of the `serving` workers could ever hold whole (worker_fit.py),
    saying what it lacks: the CPUs or the memory, where no worker has that much, else the one
    worker with all of it."""
    if not worker_fit.none_holds(spec, serving):
        return
    cpus = max(int(w.get("cpus", 0)) for w in serving)
    if spec.cpus > cpus:
        raise NoWorkerFits(f"{spec.cpus} CPUs", spec.queue, f"{cpus} CPUs for jobs")
    mem = max(int(w["job_memory"]) for w in serving)
    if spec.mem > mem:
        raise NoWorkerFits(
            f"{spec.mem / 2**30:.1f} GiB of memory", spec.queue, f"{mem / 2**30:.1f} GiB for jobs"
        )
    raise GpupoolError(
        f"needs {worker_fit.needs(spec)} on one worker; no worker "
        f"serving queue {spec.queue!r} has them all (each is short of one). Enqueue it with "
        "--wait-for-worker to keep it queued until such a worker joins",
        ErrorCode.INVALID_ARGUMENT,
    )
