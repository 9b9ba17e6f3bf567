"""What a worker keeps about its GPUs: which attempt holds which (gpus.GpuAllocator), the probe of a
GPU after a job, NVML's handle where NVML found them, their readings (gpu_readings.py) and what is
done with each for the attempts on them (gpu_watch.py), and their health (health_watch.py).

It stands apart from the dispatcher (dispatcher.Worker, which holds one as `gpu_books`) because
none of it is about claims, slots or an attempt's life: the dispatcher asks it for an attempt's
GPUs and gives them back, asks what GPUs a claim may count on (NVML's free memory of the shared
ones among them), and is woken (`wake`) when GPUs come back into use: out of quarantine, clean
(`recheck_quarantine`), or healthy again. Its background tasks (the readings, the health watch,
the quarantine checks) are the worker's, spawned with its `spawn`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from daemon.aio import in_daemon_thread
from daemon.job import Lease
from daemon.metrics.worker import GpuSample, GpuSampler, WorkerMetrics
from daemon.queue.claims import Capacity, SharedGpu
from daemon.queue.job_queue import JobQueue
from daemon.worker.attempt import Holdings, latest_ends
from daemon.worker.gpu_readings import GpuReadings
from daemon.worker.gpu_watch import GpuWatch, Spawn
from daemon.worker.gpus import GpuAllocator, GpuInfo, GpuProbe, Nvml, recheck_quarantine, sample_gpus
from daemon.worker.health_watch import HealthWatch
from daemon.worker.idle_gpus import IdlePolicy
from daemon.worker.nvml_asks import GpuAsks
from daemon.worker.nvml_life import close_within, discover_within
from daemon.worker.run_types import Run, RunResult

log = logging.getLogger(__name__)

FREE_MEMORY_SECONDS = 2.0  # how long a claim waits for NVML's free memory before claiming without it


class GpuBooks:
    """A worker's GPUs, as `Worker.__init__` is given them. `gpus=None` discovers them with NVML at
    `find` (`probe` is then NVML); tests pass a list (the seam) and optionally a probe, and
    `sampler` reads given `gpus` live (discovered ones are read by NVML). `max_jobs`: the --gpu-mem
    jobs one GPU may take at most. The health of discovered GPUs is watched (health_watch.py): a
    faulty one is quarantined, its job handed back (`health` policy "requeue") or let finish
    ("let_finish"), and it comes back once no fault is seen for `health`'s clear seconds and its
    check passes. `idle`: when a job that leaves its GPUs idle is flagged, and what its queue does
    then (idle_gpus.py). `held`: the worker's attempts, whose GPUs' readings they keep; `wake`
    and `spawn`: the worker's wake of its dispatcher and its spawn of background tasks."""

    health: HealthWatch | None = None  # the GPUs' health, watched from `start` where NVML found them

    def __init__(
        self,
        queue: JobQueue,
        held: Holdings,
        gpus: Sequence[GpuInfo] | None,
        sampler: GpuSampler | None,
        probe: GpuProbe | None,
        *,
        slots: int,
        max_jobs: int,
        health: tuple[str, float],
        idle: IdlePolicy,
        every: float,
        wake: asyncio.Event,
        spawn: Spawn,
    ) -> None:
        self._given_gpus, self._given_sampler = gpus, sampler
        self.probe = probe
        self._slots = slots
        self.max_jobs = max_jobs
        self.allocator = GpuAllocator(gpus or [], slots, max_jobs)
        self._health_settings = health
        self._held = held
        self._wake = wake
        self._spawn = spawn
        self.readings = GpuReadings({}, every)  # replaced at `find`, once the GPUs are known
        self._sampled = False  # whether the readings read anything (the metrics serve them then)
        self._nvml: Nvml | None = None
        # The asks of NVML for the processes on a GPU, of the jobs' end checks (leftovers.py, through
        # their runs) and the quarantine checks: one at a time per GPU, however many jobs end on it,
        # so that a GPU whose NVML hangs holds one thread for them all.
        self.pids_asks: GpuAsks[set[int]] = GpuAsks("gpupool-gpu-pids")
        # each attempt's GPU usage summary and idle clock, fed by the readings (gpu_watch.py)
        self.gpu_watch = GpuWatch(queue, idle, spawn)

    # -- life cycle -------------------------------------------------------------------------------

    async def find(self, every: float) -> Sequence[GpuInfo]:
        """The GPUs (discovered with NVML unless given), and their readings every `every` seconds
        made ready (not yet run: `start`)."""
        if self._given_gpus is None:
            gpus, self._nvml = await discover_within()
            self.allocator = GpuAllocator(gpus, self._slots, self.max_jobs)
            self.probe = self.probe or self._nvml
        gpus = self.allocator.gpus
        readers: dict[str, GpuSampler] = {}
        if self._nvml is not None:  # one reader per GPU: a GPU whose NVML hangs holds only its own
            readers = {g.uuid: functools.partial(sample_gpus, [g]) for g in gpus}
        elif self._given_sampler is not None:
            readers = {"given GPUs": self._given_sampler}
        self.readings = GpuReadings(readers, every, self._read)
        self._sampled = bool(readers)
        return gpus

    def metrics(self) -> WorkerMetrics:
        """The worker's metrics for these GPUs, once found. They serve the latest readings: a scrape
        never asks NVML (which may hang on a GPU)."""
        return WorkerMetrics(self.allocator.gpus, self.readings.samples if self._sampled else None)

    def start(self, runs: Callable[[], Iterable[Run]], every: float) -> None:
        """Run the readings, and watch the health of GPUs NVML found every `every` seconds (a
        faulty one's jobs among `runs` are handed back or let finish, as the policy says)."""
        self._spawn(self.readings.run(), "GPU readings")
        gpus = self.allocator.gpus
        if self._nvml is not None and gpus:
            policy, clear = self._health_settings
            self.health = HealthWatch(
                gpus, self.allocator, runs, self._back, every=every, clear=clear, policy=policy
            )
            self._spawn(self.health.run(), "GPU health")

    async def close(self) -> None:
        """NVML's handle closed (within a bound: it may hang), where NVML found the GPUs."""
        if self._nvml is not None:
            await close_within(self._nvml)
            self._nvml = None

    # -- an attempt's GPUs ------------------------------------------------------------------------

    def allocate(self, lease: Lease, slot: int) -> tuple[GpuInfo, ...]:
        """The GPUs the attempt runs on (raises gpus.NotEnoughGpus when they are not free)."""
        if lease.spec.gpu_mem:  # on the GPU the claim chose (claim.lua)
            uuid = self.allocator.gpus[lease.shared_gpu].uuid if lease.shared_gpu >= 0 else ""
            return (self.allocator.allocate_shared(lease.id, uuid, lease.spec.gpu_mem),)
        return self.allocator.allocate(lease.id, lease.spec.gpus, slot)

    def release(self, lease: Lease, result: RunResult | None) -> None:
        """The attempt's GPUs given back, the ones its run left dirty into quarantine."""
        if result is not None:
            for uuid, why in result.dirty_gpus.items():
                self.allocator.quarantine(uuid, f"after job {lease.job_id}: {why}")
        self.allocator.release(lease.id)

    def check_quarantine(self) -> None:
        """See, in a task, whether the quarantined GPUs are clean now (where a probe can say)."""
        if self.allocator.quarantined and self.probe is not None:
            self._spawn(self._recheck_quarantine(), "quarantine check")

    def _back(self) -> None:
        """A GPU passed its health check: claim for it, and see whether it is clean (a job
        stopped on it while NVML could not answer left it counted as dirty)."""
        self._wake.set()
        self.check_quarantine()

    async def _recheck_quarantine(self) -> None:
        assert self.probe is not None
        if await recheck_quarantine(self.allocator, self.probe, self.pids_asks):
            self._wake.set()

    def _read(self, samples: Sequence[GpuSample], at: float) -> None:
        self.gpu_watch.read(self._held, samples, at)

    # -- what claims may count on -----------------------------------------------------------------

    def capacity(self, grace: float) -> Capacity:
        """What its GPUs let a claim take now (claims.Capacity): those free whole, a slot's share,
        those usable in all, and when the attempts holding some end at the latest (backfill; each's
        `grace` to stop counted)."""
        return Capacity(
            gpus_free=self.allocator.free_count(),
            slot_gpus=self.allocator.share,
            gpus_total=self.allocator.usable(),
            ends=latest_ends(self._held, self._gpus_held, grace),
            grace=grace,
        )

    def _gpus_held(self, lease_id: str) -> int:
        return len(self.allocator.held_by(lease_id))

    async def shared(self, room: Capacity) -> Capacity:
        """`room` with the GPUs that can take a --gpu-mem job (NVML's free memory read now)."""
        if not self.allocator.gpus:
            return room
        uuids = [g.uuid for g in self.allocator.gpus]
        free = await self._free_memory([u for u in uuids if not self.allocator.out_of_use(u)])
        whole = {g.uuid for g in self.allocator.free()}
        return dataclasses.replace(
            room,
            shared=[
                SharedGpu(place, r.avail, r.jobs, r.uuid not in whole, self.allocator.gpus[place].memory)
                for r in self.allocator.shared_table(free)
                for place in (uuids.index(r.uuid),)
            ],
            largest_gpu=max(g.memory for g in self.allocator.gpus),
        )

    async def _free_memory(self, uuids: list[str]) -> dict[str, int] | None:
        """NVML's free memory of `uuids` (GPUs in use: one out for its health may hang it), read in
        a daemon thread within FREE_MEMORY_SECONDS: a hung read holds no claim, nor the worker's
        exit (the default executor's threads are waited for at the end); None, unknown, then."""
        nvml = self._nvml
        if nvml is None or not uuids:
            return None
        reading = in_daemon_thread(lambda: nvml.free_memory(uuids), "NVML free memory")
        try:
            return await asyncio.wait_for(reading, FREE_MEMORY_SECONDS)
        except TimeoutError:
            why = "NVML did not say the GPUs' free memory in %g s: claiming by what jobs declared"
            log.warning(why, FREE_MEMORY_SECONDS)
            return None

    # -- reads ------------------------------------------------------------------------------------

    def describe(self) -> list[dict[str, Any]]:
        """Each GPU as the registration says it: its share, latest reading and health."""
        return [g | self.readings.for_gpu(g["uuid"]) | self._health_of(g) for g in self.allocator.describe()]

    def _health_of(self, gpu: Mapping[str, Any]) -> dict[str, Any]:
        return self.health.for_gpu(gpu["uuid"], gpu.get("parent")) if self.health is not None else {}

    def sample_into(self, metrics: WorkerMetrics) -> None:
        """Before each scrape: the quarantined GPUs, the shared ones and their health as they are now."""
        metrics.set_quarantined(self.allocator.quarantined)
        metrics.set_shared(self.allocator.shares())
        if self.health is not None:
            metrics.set_health(self.health.reasons())
