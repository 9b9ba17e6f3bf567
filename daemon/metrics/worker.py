"""A worker's metrics: its slots, heartbeats, job starts, bytes moved, its GPUs' live readings and
how many --gpu-mem jobs share each GPU.

What happens (a heartbeat returns, an attempt starts, bytes cross to or from the object store) is
recorded in place by the typed methods of `WorkerMetrics`. The GPUs' live series are the worker's
latest readings, taken once per heartbeat interval, never a read at scrape time: NVML may hang on
a failing GPU, and a scrape that waited for it would answer nothing at all (not even which GPU is
out, and why) for as long as it hangs.

metrics/ never asks NVML itself: the worker hands `WorkerMetrics` a callable (`sample_gpus`, in
practice daemon.worker.gpu_readings.GpuReadings.samples) that returns the latest `GpuSample` of
each GPU it could read. The sample's shape is defined here, on the side that reads it, so that
metrics/ depends on no worker code and tests feed it made-up readings.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from daemon.metrics.common import RTT_BUCKETS, QueueLabels, new_registry

TRANSFER_DIRECTIONS = ("upload", "download")
# The GPU health faults (daemon/worker/gpu_health.py FAULTS), the `reason` of gpupool_gpu_healthy.
HEALTH_REASONS = ("xid", "ecc", "pages", "lost", "hung", "thermal", "power")
EFFICIENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


class Gpu(Protocol):
    """A GPU as the worker knows it (daemon.worker.gpus.GpuInfo is one)."""

    @property
    def index(self) -> int: ...

    @property
    def uuid(self) -> str: ...


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU's live readings at one time. A reading the driver could not give (not supported,
    e.g. utilisation in MIG mode, or a transient error) is None and left out of that scrape."""

    uuid: str
    utilization: float | None = None  # busy time, 0-1
    memory_used: int | None = None  # bytes
    memory_total: int | None = None  # bytes
    temperature: float | None = None  # celsius
    power_w: float | None = None  # the board's draw now, watts
    energy_mj: int | None = None  # NVML's total energy since the driver loaded, millijoules (Volta on)


@dataclass(frozen=True, slots=True)
class GpuShare:
    """How many pool jobs share one GPU (poolctl enqueue --gpu-mem) and the bytes they declared,
    from the worker's books (daemon.worker.gpus.GpuAllocator.shares gives one per GPU)."""

    uuid: str
    jobs: int = 0
    memory: int = 0  # bytes


# A sample for each GPU it could read (a GPU fallen off the bus, or no driver, gives none): what
# the worker's GPU readers return (gpu_readings.py), and what the collection thread gets at each
# scrape, there the latest readings, which must not block (no NVML).
GpuSampler = Callable[[], Sequence[GpuSample]]


class _GpuCollector(Collector):
    """Per-GPU utilisation, memory and temperature from the sampler, and the quarantine flag, the
    health verdict and the jobs sharing it from the worker's books. No GPU yields no family at
    all; a GPU without a sample has no live series, and one whose health is not watched no
    health series."""

    def __init__(
        self,
        gpus: Sequence[Gpu],
        sample: GpuSampler | None,
        quarantined: Callable[[], Collection[str]],
        shares: Callable[[], Mapping[str, GpuShare]],
        health: Callable[[], Mapping[str, str]],
    ) -> None:
        self._gpus = tuple(gpus)
        self._sample = sample
        self._quarantined = quarantined
        self._shares = shares
        self._health = health

    def collect(self) -> Iterator[Metric]:
        labels = ["gpu", "uuid"]
        util = GaugeMetricFamily("gpupool_gpu_utilization_ratio", "GPU busy time (0-1).", labels=labels)
        used = GaugeMetricFamily("gpupool_gpu_memory_used_bytes", "GPU memory in use.", labels=labels)
        total = GaugeMetricFamily("gpupool_gpu_memory_total_bytes", "GPU memory in all.", labels=labels)
        temp = GaugeMetricFamily("gpupool_gpu_temperature_celsius", "GPU core temperature.", labels=labels)
        quarantine = GaugeMetricFamily(
            "gpupool_gpu_quarantined",
            "1 if the GPU is quarantined (left dirty by a job), else 0.",
            labels=labels,
        )
        shared_jobs = GaugeMetricFamily(
            "gpupool_gpu_shared_jobs",
            "Pool jobs sharing the GPU, each with the memory it declared (--gpu-mem).",
            labels=labels,
        )
        shared_memory = GaugeMetricFamily(
            "gpupool_gpu_shared_memory_declared_bytes",
            "GPU memory the jobs sharing the GPU declared (--gpu-mem).",
            labels=labels,
        )
        healthy = GaugeMetricFamily(
            "gpupool_gpu_healthy",
            "1 if the GPU is healthy, 0 if a health fault took it out of use; `reason` says which "
            f"({', '.join(HEALTH_REASONS)}; none when healthy).",
            labels=[*labels, "reason"],
        )
        quarantined = self._quarantined()
        shares = self._shares()
        health = self._health()
        samples = {s.uuid: s for s in self._sample()} if self._gpus and self._sample is not None else {}
        for gpu in self._gpus:
            values = [str(gpu.index), gpu.uuid]
            quarantine.add_metric(values, 1 if gpu.uuid in quarantined else 0)
            share = shares.get(gpu.uuid, GpuShare(gpu.uuid))
            shared_jobs.add_metric(values, share.jobs)
            shared_memory.add_metric(values, share.memory)
            if (fault := health.get(gpu.uuid)) is not None:
                healthy.add_metric([*values, fault or "none"], 0 if fault else 1)
            if (s := samples.get(gpu.uuid)) is None:
                continue
            for family, reading in (
                (util, s.utilization),
                (used, s.memory_used),
                (total, s.memory_total),
                (temp, s.temperature),
            ):
                if reading is not None:
                    family.add_metric(values, reading)
        for family in (util, used, total, temp, quarantine, shared_jobs, shared_memory, healthy):
            if family.samples:
                yield family


class WorkerMetrics:
    """A worker's metrics. `gpus` are the GPUs discovery found (none on a CPU worker);
    `sample_gpus` gives their latest readings at each scrape (None: no live GPU series)."""

    def __init__(self, gpus: Sequence[Gpu] = (), sample_gpus: GpuSampler | None = None) -> None:
        self.registry = new_registry("worker")
        r = self.registry
        self._queue = QueueLabels()
        self._quarantined: frozenset[str] = frozenset()
        self._shares: dict[str, GpuShare] = {}
        self._health: dict[str, str] = {}
        r.register(
            _GpuCollector(
                gpus, sample_gpus, lambda: self._quarantined, lambda: self._shares, lambda: self._health
            )
        )
        self._slots = Gauge("gpupool_worker_slots", "This worker's slots by state.", ["state"], registry=r)
        self.set_slots(0, 0)
        self._quarantined_count = Gauge(
            "gpupool_worker_gpus_quarantined", "GPUs this worker holds back as dirty.", registry=r
        )
        self._started = Counter(
            "gpupool_jobs_started", "Job attempts this worker started.", ["queue"], registry=r
        )
        self._heartbeat = Histogram(
            "gpupool_heartbeat_roundtrip_seconds",
            "Round trip of a successful heartbeat (registration and lease renewals).",
            buckets=RTT_BUCKETS,
            registry=r,
        )
        self._heartbeat_failures = Counter(
            "gpupool_heartbeat_failures", "Heartbeats that failed (Redis unreachable).", registry=r
        )
        self._efficiency = Histogram(
            "gpupool_job_gpu_efficiency",
            "Each attempt's GPU efficiency at its end: utilisation-weighted GPU-hours over allocated "
            "GPU-hours (0-1).",
            ["queue"],
            buckets=EFFICIENCY_BUCKETS,
            registry=r,
        )
        self._transferred = Counter(
            "gpupool_transfer_bytes", "Bytes moved to and from the object store.", ["direction"], registry=r
        )
        for direction in TRANSFER_DIRECTIONS:
            self._transferred.labels(direction)  # present at 0 from the start

    def set_slots(self, busy: int, total: int) -> None:
        self._slots.labels("busy").set(busy)
        self._slots.labels("free").set(max(0, total - busy))

    def set_quarantined(self, uuids: Collection[str]) -> None:
        """The UUIDs of the GPUs now quarantined (the whole set, not a change)."""
        self._quarantined = frozenset(uuids)
        self._quarantined_count.set(len(self._quarantined))

    def set_shared(self, shares: Collection[GpuShare]) -> None:
        """How many --gpu-mem jobs share each GPU now, and the memory they declared (the whole
        picture, not a change; a GPU left out has none)."""
        self._shares = {s.uuid: s for s in shares}

    def set_health(self, reasons: Mapping[str, str]) -> None:
        """Each watched GPU's health fault by UUID ("" for healthy; one of HEALTH_REASONS), the
        whole picture, not a change (a GPU left out has no health series)."""
        unknown = {r for r in reasons.values() if r and r not in HEALTH_REASONS}
        if unknown:
            raise ValueError(f"GPU health reasons must be among {HEALTH_REASONS}, not {sorted(unknown)}")
        self._health = dict(reasons)

    def job_started(self, queue: str) -> None:
        """An attempt of a job from `queue` was given its slot and is starting."""
        self._started.labels(self._queue(queue)).inc()

    def job_efficiency(self, queue: str, efficiency: float) -> None:
        """An attempt of a job from `queue` that held GPUs ended having used them `efficiency`
        (0-1) of its time (worker/gpu_usage.py)."""
        self._efficiency.labels(self._queue(queue)).observe(efficiency)

    def heartbeat(self, rtt_s: float) -> None:
        self._heartbeat.observe(rtt_s)

    def heartbeat_failed(self) -> None:
        self._heartbeat_failures.inc()

    def transferred(self, direction: str, nbytes: int) -> None:
        """`direction` is "upload" (to the object store) or "download"."""
        if direction not in TRANSFER_DIRECTIONS:
            raise ValueError(f"direction must be one of {TRANSFER_DIRECTIONS}, not {direction!r}")
        self._transferred.labels(direction).inc(nbytes)
