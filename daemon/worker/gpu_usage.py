"""What an attempt's GPUs did over its life: a compact running summary of their readings.

The worker reads every GPU once per heartbeat interval (gpu_readings.py); each running attempt
that holds GPUs keeps a `GpuUsage` fed with the readings of its own GPUs, and the summary goes
into its outcome's record (`gpu_usage`, docs/PROTOCOL.md). Nothing grows with the attempt's
length: utilisation is counted in a histogram of 101 whole-percent buckets, which gives the mean
and the 95th percentile to a percent without keeping a sample; memory keeps its peak; energy is
NVML's total-energy counter's rise where the GPU has one, else its power integrated over the time
between readings.

Efficiency is one number for the attempt: its utilisation-weighted GPU-hours over its allocated
GPU-hours. Every GPU is held for the whole attempt and read at one steady interval, so that is the
mean, over its GPUs, of each GPU's mean utilisation (0-1). A GPU whose utilisation NVML cannot
read (MIG mode) is left out of it rather than counted as idle; with none read it is None. NVML
reads a GPU whole: on one shared by --gpu-mem jobs each job's summary holds its neighbours' work
too, and none of them is idle while one works. A MIG device is a GPU of its own here, as it is to
the allocator.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from daemon.metrics.worker import GpuSample

BUCKETS = 101  # whole percents, 0 to 100


def percentile(counts: Sequence[int], q: float) -> float | None:
    """The smallest bucket (a whole percent) at or below which `q` (0-1) of the counted readings
    lie; None with none counted."""
    total = sum(counts)
    if not total:
        return None
    wanted, seen = q * total, 0
    for percent, n in enumerate(counts):
        seen += n
        if seen >= wanted:
            return float(percent)
    return float(len(counts) - 1)


@dataclass(slots=True)
class _OneGpu:
    """One GPU's running summary."""

    uuid: str
    index: int
    counts: list[int] = field(default_factory=lambda: [0] * BUCKETS)
    util_sum: float = 0.0  # percents, for an exact mean (the buckets round)
    samples: int = 0  # readings taken, whatever they held
    mem_peak: int | None = None
    energy_j: float = 0.0
    energy_reads: int = 0  # readings that carried the energy counter or the power
    energy_first_at: float | None = None  # when the first and last of them were taken
    energy_last_at: float | None = None
    first_counter_mj: int | None = None  # NVML's total-energy counter at the first reading
    last_counter_mj: int | None = None
    last_power_at: tuple[float, float] | None = None  # (watts, at) of the last reading with power

    def add(self, s: GpuSample, at: float) -> None:
        self.samples += 1
        if s.utilization is not None:
            percent = min(100.0, max(0.0, s.utilization * 100))
            self.counts[round(percent)] += 1
            self.util_sum += percent
        if s.memory_used is not None:
            self.mem_peak = s.memory_used if self.mem_peak is None else max(self.mem_peak, s.memory_used)
        if s.energy_mj is not None or s.power_w is not None:
            self.energy_reads += 1
            if self.energy_first_at is None:
                self.energy_first_at = at
            self.energy_last_at = at
        if s.energy_mj is not None:
            if self.first_counter_mj is None:
                self.first_counter_mj = s.energy_mj
            self.last_counter_mj = s.energy_mj
        elif s.power_w is not None:
            if self.last_power_at is not None:
                watts, then = self.last_power_at
                self.energy_j += (watts + s.power_w) / 2 * max(0.0, at - then)  # the trapezoid
            self.last_power_at = (s.power_w, at)

    @property
    def util_count(self) -> int:
        return sum(self.counts)

    def util_mean(self) -> float | None:
        n = self.util_count
        return round(self.util_sum / n, 2) if n else None

    def energy(self, duration: float) -> float | None:
        """Joules over `duration` seconds: the energy measured between the first and last
        readings is a mean power, carried over the whole attempt (the time before the first
        reading and after the last was drawn too); unknown with fewer than two readings, which
        measure no interval at all."""
        if self.energy_reads < 2 or self.energy_first_at is None or self.energy_last_at is None:
            return None
        span = self.energy_last_at - self.energy_first_at
        if self.first_counter_mj is not None and self.last_counter_mj is not None:
            measured = (self.last_counter_mj - self.first_counter_mj) / 1000
        else:
            measured = self.energy_j
        if span <= 0:
            return None
        return round(measured / span * max(span, duration), 3)

    def summary(self, duration: float) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "index": self.index,
            "util_mean": self.util_mean(),
            "util_p95": percentile(self.counts, 0.95),
            "mem_peak": self.mem_peak,
            "energy_j": self.energy(duration),
            "samples": self.samples,
        }


class GpuUsage:
    """The running summary of one attempt's GPUs (given as (index, uuid) pairs): `add` each
    reading as it comes, `summary()` at the attempt's end."""

    def __init__(self, gpus: Iterable[tuple[int, str]], started: float | None = None) -> None:
        self._gpus = {uuid: _OneGpu(uuid, index) for index, uuid in gpus}
        self.started = time.time() if started is None else started  # the attempt's start

    @property
    def uuids(self) -> frozenset[str]:
        return frozenset(self._gpus)

    def add(self, samples: Iterable[GpuSample], at: float) -> None:
        """One reading of the GPUs taken at `at` (seconds); those not this attempt's are skipped."""
        for s in samples:
            if (gpu := self._gpus.get(s.uuid)) is not None:
                gpu.add(s, at)

    def summary(self, ended: float | None = None) -> dict[str, Any] | None:
        """The record's `gpu_usage` (docs/PROTOCOL.md) for the attempt ended at `ended` (now if
        not given); None before any reading was taken."""
        duration = max(0.0, (time.time() if ended is None else ended) - self.started)
        gpus = sorted(self._gpus.values(), key=lambda g: g.index)
        if not any(g.samples for g in gpus):
            return None
        counts = [sum(g.counts[i] for g in gpus) for i in range(BUCKETS)]
        read = [g for g in gpus if g.util_count]
        util_sum, util_n = sum(g.util_sum for g in read), sum(g.util_count for g in read)
        means = [g.util_sum / g.util_count for g in read]
        peaks = [g.mem_peak for g in gpus if g.mem_peak is not None]
        energies = [e for g in gpus if (e := g.energy(duration)) is not None]
        return {
            "util_mean": round(util_sum / util_n, 2) if util_n else None,
            "util_p95": percentile(counts, 0.95),
            "mem_peak": max(peaks) if peaks else None,
            "energy_j": round(sum(energies), 3) if energies else None,
            "efficiency": round(sum(means) / len(means) / 100, 4) if means else None,
            "samples": sum(g.samples for g in gpus),
            "gpus": [g.summary(duration) for g in gpus],
        }
