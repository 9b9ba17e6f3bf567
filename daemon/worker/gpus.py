"""A worker's GPUs: discovery and sampling with NVML, and the bookkeeping of which job holds which GPU.

This is the one module that reads NVML. Discovery (`discover`) asks it once, at start;
`sample_gpus` reads the GPUs' utilisation, memory and temperature at each metrics scrape (the worker
hands it to `WorkerMetrics`, which never imports pynvml). Without the NVIDIA driver, or without GPUs, NVML
raises `NVMLError` (or sees nothing): the worker then runs as a CPU worker, says so once, and only
takes jobs that need no GPU. It never crashes for want of a GPU.

Assignment (`GpuAllocator`) is pure bookkeeping over a list of `GpuInfo`, so tests drive it with a
made-up list instead of NVML (the seam). Its rules:

- A worker's GPUs are divided among its slots: each slot has `share = GPUs // slots` *home* GPUs.
  A job that asks for no GPU in particular (`gpus=0`) gets `share` GPUs, its slot's home ones when
  they are free; on a machine with fewer GPUs than slots, such a job gets none (ask with --gpus).
- A job that asks for N GPUs gets N free ones: its slot's home first, then GPUs that are no slot's
  home, then other slots' home GPUs, lowest index first.
- A GPU is held by at most one job at a time; `release` gives a job's GPUs back.
- A GPU left dirty (a process of a finished job still holds memory on it) is quarantined: never
  handed out again until `unquarantine` (the worker re-checks it when other jobs end).

Jobs see their GPUs through CUDA_VISIBLE_DEVICES naming them by UUID: NVML and CUDA may number
GPUs differently (CUDA orders by speed unless CUDA_DEVICE_ORDER=PCI_BUS_ID), a UUID is the same
for both.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pynvml

from daemon.metrics.worker import GpuSample

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int  # NVML's index, for humans; jobs are given the UUID
    uuid: str  # e.g. GPU-5c3f0f7e-...
    name: str
    memory: int  # bytes

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "name": self.name, "memory": self.memory}


class GpuProbeError(Exception):
    """A GPU could not be checked (NVML failed on it): the runner treats it as dirty."""


class GpuProbe(Protocol):
    """What the runner asks after a job: which processes hold memory on a GPU now. Raises
    GpuProbeError when it cannot tell."""

    def compute_pids(self, uuid: str) -> set[int]: ...


class Nvml:
    """An initialised NVML library. Raises `pynvml.NVMLError` when there is no usable driver."""

    def __init__(self) -> None:
        pynvml.nvmlInit()

    def gpus(self) -> list[GpuInfo]:
        out = []
        for i in range(int(pynvml.nvmlDeviceGetCount())):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            out.append(
                GpuInfo(
                    index=i,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    memory=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                )
            )
        return out

    def compute_pids(self, uuid: str) -> set[int]:
        """Pids of the processes holding memory on the GPU `uuid` (compute and graphics contexts)."""
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            procs = list(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
            procs += pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle)
        except pynvml.NVMLError as exc:
            raise GpuProbeError(str(exc)) from None
        return {int(p.pid) for p in procs}

    def close(self) -> None:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.warning("NVML shutdown failed: %s", exc)


def _text(value: object) -> str:
    # nvidia-ml-py returns str; versions before 11.5 returned bytes.
    return value.decode() if isinstance(value, bytes) else str(value)


def discover() -> tuple[list[GpuInfo], Nvml | None]:
    """This machine's GPUs and the NVML handle to probe them with, or ([], None) for a CPU worker.
    Logs which, once: call it once per worker."""
    try:
        nvml = Nvml()
    except pynvml.NVMLError as exc:
        log.info("no NVIDIA driver usable (%s): running as a CPU worker, taking only jobs without GPUs", exc)
        return [], None
    try:
        gpus = nvml.gpus()
    except pynvml.NVMLError as exc:
        log.warning("NVML cannot list the GPUs (%s): running as a CPU worker", exc)
        nvml.close()
        return [], None
    if not gpus:
        log.info("NVML sees no GPU on this machine: running as a CPU worker, taking only jobs without GPUs")
        nvml.close()
        return [], None
    for g in gpus:
        log.info("GPU %d: %s, %.1f GiB, %s", g.index, g.name, g.memory / 2**30, g.uuid)
    return gpus, nvml


def sample_gpus(gpus: Iterable[GpuInfo]) -> list[GpuSample]:
    """The live readings of `gpus` for a metrics scrape. NVML must be initialised (`discover` leaves
    it so when it finds GPUs). A GPU NVML cannot find (no driver, fallen off the bus) gives no
    sample; a query it cannot answer (not supported, e.g. utilisation in MIG mode, or a transient
    error) leaves that reading None. Blocking, and it may hang on a failing GPU: the metrics
    endpoint calls it from a thread."""
    out = []
    for gpu in gpus:
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
        except pynvml.NVMLError:
            continue
        utilization = used = total = temperature = None
        with contextlib.suppress(pynvml.NVMLError):
            utilization = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100
        with contextlib.suppress(pynvml.NVMLError):
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            used, total = int(memory.used), int(memory.total)
        with contextlib.suppress(pynvml.NVMLError):
            temperature = float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
        out.append(GpuSample(gpu.uuid, utilization, used, total, temperature))
    return out


def visible_devices(gpus: Iterable[GpuInfo]) -> str:
    """CUDA_VISIBLE_DEVICES for `gpus`: their UUIDs; "" (no GPU visible) for none."""
    return ",".join(g.uuid for g in gpus)


class NotEnoughGpus(Exception):
    """`allocate` was asked for more GPUs than are free (the worker claimed beyond its means)."""


class GpuAllocator:
    """Which job holds which of a worker's GPUs. Not thread-safe: the worker's event loop owns it."""

    def __init__(self, gpus: Sequence[GpuInfo], slots: int) -> None:
        self.gpus = sorted(gpus, key=lambda g: g.index)
        self.slots = slots
        self.share = len(self.gpus) // slots if slots > 0 else 0
        self._home = {slot: self.gpus[slot * self.share : (slot + 1) * self.share] for slot in range(slots)}
        self._homed = {g.uuid for home in self._home.values() for g in home}
        self._holder: dict[str, str] = {}  # GPU uuid -> holder (a job's attempt)
        self.quarantined: dict[str, str] = {}  # GPU uuid -> why

    def wanted(self, asked: int) -> int:
        """How many GPUs a job asking for `asked` gets: `asked`, or its slot's share for 0."""
        return asked or self.share

    def free(self) -> list[GpuInfo]:
        return [g for g in self.gpus if g.uuid not in self._holder and g.uuid not in self.quarantined]

    def free_count(self) -> int:
        return len(self.free())

    def held_by(self, holder: str) -> list[GpuInfo]:
        return [g for g in self.gpus if self._holder.get(g.uuid) == holder]

    def allocate(self, holder: str, asked: int, slot: int) -> tuple[GpuInfo, ...]:
        """Give `holder` (a job's attempt) the GPUs it gets (see the module's rules). Raises
        NotEnoughGpus, holding nothing, when too few are free."""
        n = self.wanted(asked)
        if n == 0:
            return ()
        free = self.free()
        if len(free) < n:
            raise NotEnoughGpus(f"{holder} needs {n} GPUs, {len(free)} of {len(self.gpus)} are free")
        home = {g.uuid for g in self._home.get(slot, [])}
        # Home first keeps a slot on the same GPUs job after job; spares before others' homes
        # leaves the other slots their own GPUs.
        free.sort(key=lambda g: (g.uuid not in home, g.uuid in self._homed, g.index))
        chosen = sorted(free[:n], key=lambda g: g.index)
        for g in chosen:
            self._holder[g.uuid] = holder
        return tuple(chosen)

    def release(self, holder: str) -> None:
        """Give back every GPU `holder` holds (quarantined ones stay out of use)."""
        for uuid in [u for u, h in self._holder.items() if h == holder]:
            del self._holder[uuid]

    def quarantine(self, uuid: str, reason: str) -> None:
        if uuid not in self.quarantined:
            log.error("GPU %s quarantined: %s; it is not handed out until it is clean", uuid, reason)
        self.quarantined[uuid] = reason

    def unquarantine(self, uuid: str) -> None:
        if self.quarantined.pop(uuid, None) is not None:
            log.info("GPU %s is clean again and back in use", uuid)

    def describe(self) -> list[dict[str, Any]]:
        """The GPUs for the worker's registration: each with its holder and quarantine reason."""
        return [
            g.to_dict()
            | {"job": self._holder.get(g.uuid, ""), "quarantined": self.quarantined.get(g.uuid, "")}
            for g in self.gpus
        ]
