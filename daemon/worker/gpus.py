"""A worker's GPUs: discovery and sampling with NVML, and the bookkeeping of which job holds which GPU.

This is the one module that reads NVML. Discovery (`discover`) asks it once, at start; a GPU in MIG
mode is listed as its MIG devices, each a GPU of its own to the pool (CUDA_VISIBLE_DEVICES takes
their MIG- UUIDs), since a job on one cannot see or touch the others' memory or compute;
`sample_gpu` reads a GPU's utilisation, memory, temperature, power and energy, once per heartbeat
interval (gpu_readings.py, whose latest readings the metrics serve: metrics/ never imports
pynvml). Without the NVIDIA driver, or without GPUs, NVML raises `NVMLError` (or sees nothing):
the worker then runs as a CPU worker, says so once, and only takes jobs that need no GPU. It never
crashes for want of a GPU. NVML may hang on a failing GPU: the worker asks it within a bound
(nvml_asks.py; its start and close: nvml_life.py).

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
- A GPU with a health fault (read from NVML by gpu_health.py, the one other module that reads it;
  health_watch.py) is out of use until `mark_healthy`: handed out to no job, and not counted among
  the GPUs the worker has (`usable`), so that claims do not wait for it.
- Sharing (`poolctl enqueue --gpu-mem`): a job that declares the memory it needs on one GPU is put
  on a GPU with other such jobs (`allocate_shared`), at most `max_jobs_per_gpu` of them, their
  declared memory within the GPU's. A GPU shared is never handed out whole, and a GPU held whole is
  never shared, so a whole-GPU job keeps the promise of a GPU of its own. The claim chooses the GPU
  from `shared_table`, which lists the GPUs already shared first, so that shared jobs pack onto as
  few GPUs as they can and leave the others whole. Declared memory is a promise, not a limit: the
  pool cannot stop a job from using more (MIG can; MPS limits are the job's own business), so
  `shared_table` also counts what NVML sees free, which a job using more than it declared eats into.

Jobs see their GPUs through CUDA_VISIBLE_DEVICES naming them by UUID: NVML and CUDA may number
GPUs differently (CUDA orders by speed unless CUDA_DEVICE_ORDER=PCI_BUS_ID), a UUID is the same
for both.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pynvml

from daemon.metrics.worker import GpuSample, GpuShare
from daemon.worker.nvml_asks import GpuAsks

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int  # NVML's index, for humans (a MIG device's is its GPU's); jobs are given the UUID
    uuid: str  # e.g. GPU-5c3f0f7e-..., or MIG-... for a MIG device
    name: str
    memory: int  # bytes
    parent: str | None = None  # a MIG device's physical GPU (its UUID); None for a whole GPU
    minor: int | None = None  # its device node's minor number (/dev/nvidiaN; a MIG device's GPU's)

    def to_dict(self) -> dict[str, Any]:
        out = {"index": self.index, "uuid": self.uuid, "name": self.name, "memory": self.memory}
        return out | ({"parent": self.parent} if self.parent is not None else {})


@dataclass(frozen=True, slots=True)
class SharedRoom:
    """Room for one more --gpu-mem job on a GPU (a row of `GpuAllocator.shared_table`): `avail`
    bytes (the least of what NVML sees free and what the jobs on it left undeclared) and `jobs`
    more jobs before the GPU is at `max_jobs_per_gpu`."""

    index: int
    uuid: str
    avail: int
    jobs: int


class GpuProbeError(Exception):
    """A GPU could not be checked (NVML failed on it): the runner treats it as dirty."""


class GpuProbe(Protocol):
    """What the runner asks after a job: which processes hold memory on a GPU now. Raises
    GpuProbeError when it cannot tell."""

    def compute_pids(self, uuid: str) -> set[int]: ...


class MemoryProbe(Protocol):
    """What the claim asks before it places a --gpu-mem job: the memory free on each GPU now, by
    UUID (a GPU it cannot read is left out). Blocking: call it from a thread. Tests give a dict."""

    def free_memory(self, uuids: Iterable[str]) -> dict[str, int]: ...


class Nvml:
    """An initialised NVML library. Raises `pynvml.NVMLError` when there is no usable driver."""

    def __init__(self) -> None:
        pynvml.nvmlInit()

    def gpus(self) -> list[GpuInfo]:
        """The machine's GPUs in NVML's order, a GPU in MIG mode as its MIG devices."""
        out = []
        for i in range(int(pynvml.nvmlDeviceGetCount())):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            gpu = _info(i, handle)
            if not _mig_enabled(handle):
                out.append(gpu)
                continue
            devices = _mig_devices(gpu, handle)
            if not devices:
                log.warning("GPU %d (%s) is in MIG mode with no MIG device: it is not used", i, gpu.uuid)
            out += devices
        return out

    def free_memory(self, uuids: Iterable[str]) -> dict[str, int]:
        """Bytes of memory free now on each GPU of `uuids` NVML can read (MemoryProbe)."""
        out = {}
        for uuid in uuids:
            # A GPU NVML cannot read now (fallen off the bus) is left out, as sample_gpus leaves it:
            # its jobs' own checks and the quarantine say what is wrong with it, once.
            with contextlib.suppress(pynvml.NVMLError):
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                out[uuid] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
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


def _info(index: int, handle: object, parent: GpuInfo | None = None) -> GpuInfo:
    return GpuInfo(
        index=index,
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        memory=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
        parent=parent.uuid if parent is not None else None,
        minor=parent.minor if parent is not None else _minor(handle),
    )


def _minor(handle: object) -> int | None:
    """The minor number of a whole GPU's /dev/nvidiaN, which a job given it must open; None where
    NVML cannot tell (its jobs are then not confined to their GPUs: confine.py)."""
    try:
        return int(pynvml.nvmlDeviceGetMinorNumber(handle))
    except pynvml.NVMLError:
        return None


def _mig_enabled(handle: object) -> bool:
    """Whether MIG mode is on now (a mode pending a reset does not count). A GPU without MIG
    (before A100, or a driver without it) says NotSupported: not in MIG mode."""
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError:
        return False
    return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)


def _mig_devices(gpu: GpuInfo, handle: object) -> list[GpuInfo]:
    """The MIG devices made on `gpu`: the slots up to its maximum that hold one (an empty slot
    says NotFound, or InvalidArgument on some drivers)."""
    out = []
    for i in range(int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
        except (pynvml.NVMLError_NotFound, pynvml.NVMLError_InvalidArgument):
            continue
        out.append(_info(gpu.index, mig, parent=gpu))
    return out


def count() -> int:
    """How many GPUs a worker on this machine would find (`discover`), said quietly: 0 without a
    usable driver."""
    try:
        nvml = Nvml()
    except pynvml.NVMLError:
        return 0
    try:
        return len(nvml.gpus())
    except pynvml.NVMLError:
        return 0
    finally:
        nvml.close()


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
        mig = f" (MIG device of {g.parent})" if g.parent else ""
        log.info("GPU %d: %s, %.1f GiB, %s%s", g.index, g.name, g.memory / 2**30, g.uuid, mig)
    return gpus, nvml


def sample_gpus(gpus: Iterable[GpuInfo]) -> list[GpuSample]:
    """The live readings of `gpus` (`sample_gpu` of each), those NVML could give. Blocking, and
    it may hang on a failing GPU: call it from a daemon thread."""
    return [s for gpu in gpus if (s := sample_gpu(gpu)) is not None]


def sample_gpu(gpu: GpuInfo) -> GpuSample | None:
    """The live readings of `gpu`. NVML must be initialised (`discover` leaves it so when it finds
    GPUs). A GPU NVML cannot find (no driver, fallen off the bus) gives None; a query it cannot
    answer (not supported, e.g. utilisation in MIG mode, or a transient error) leaves that reading
    None. Blocking, and it may hang on a failing GPU: the worker asks it through nvml_asks.py."""
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
    except pynvml.NVMLError:
        return None
    utilization = used = total = temperature = power = energy = None
    with contextlib.suppress(pynvml.NVMLError):
        utilization = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100
    with contextlib.suppress(pynvml.NVMLError):
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        used, total = int(memory.used), int(memory.total)
    with contextlib.suppress(pynvml.NVMLError):
        temperature = float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
    with contextlib.suppress(pynvml.NVMLError):
        power = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000  # milliwatts
    with contextlib.suppress(pynvml.NVMLError):
        energy = int(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
    return GpuSample(gpu.uuid, utilization, used, total, temperature, power, energy)


def visible_devices(gpus: Iterable[GpuInfo]) -> str:
    """CUDA_VISIBLE_DEVICES for `gpus`: their UUIDs; "" (no GPU visible) for none."""
    return ",".join(g.uuid for g in gpus)


class NotEnoughGpus(Exception):
    """`allocate` was asked for more GPUs than are free, or `allocate_shared` for a place on a GPU
    that has no room (the worker claimed beyond its means)."""


class GpuAllocator:
    """Which job holds which of a worker's GPUs, whole or shared. Not thread-safe: the worker's
    event loop owns it."""

    def __init__(self, gpus: Sequence[GpuInfo], slots: int, max_jobs_per_gpu: int = 4) -> None:
        if max_jobs_per_gpu < 1:
            raise ValueError(f"max_jobs_per_gpu must be at least 1, not {max_jobs_per_gpu}")
        self.gpus = sorted(gpus, key=lambda g: g.index)
        self.slots = slots
        self.max_jobs_per_gpu = max_jobs_per_gpu
        self.share = len(self.gpus) // slots if slots > 0 else 0
        self._home = {slot: self.gpus[slot * self.share : (slot + 1) * self.share] for slot in range(slots)}
        self._homed = {g.uuid for home in self._home.values() for g in home}
        self._by_uuid = {g.uuid: g for g in self.gpus}
        self._holder: dict[str, str] = {}  # GPU uuid -> the holder (a job's attempt) of all of it
        # GPU uuid -> {holder: bytes declared} of the --gpu-mem jobs on it; no empty maps are kept
        self._shared: dict[str, dict[str, int]] = {}
        self.quarantined: dict[str, str] = {}  # GPU uuid -> why, left dirty by a job
        self.unhealthy: dict[str, str] = {}  # GPU uuid -> why, a health fault (health_watch.py)

    def wanted(self, asked: int) -> int:
        """How many GPUs a job asking for `asked` gets: `asked`, or its slot's share for 0."""
        return asked or self.share

    def free(self) -> list[GpuInfo]:
        """The GPUs that can be handed out whole: nobody holds or shares them, none is out of use."""
        return [
            g
            for g in self.gpus
            if g.uuid not in self._holder and g.uuid not in self._shared and not self.out_of_use(g.uuid)
        ]

    def out_of_use(self, uuid: str) -> bool:
        """Quarantined (left dirty) or unhealthy: handed out to no job."""
        return uuid in self.quarantined or uuid in self.unhealthy

    def usable(self) -> int:
        """How many GPUs this worker has for claims to count: all but the unhealthy ones (a dirty
        one is expected back as soon as its job's last process is gone)."""
        return len(self.gpus) - len(self.unhealthy.keys() & self._by_uuid.keys())

    def free_count(self) -> int:
        return len(self.free())

    def held_by(self, holder: str) -> list[GpuInfo]:
        """The GPUs `holder` holds whole (not the one it may share: `shared_by`)."""
        return [g for g in self.gpus if self._holder.get(g.uuid) == holder]

    def shared_by(self, holder: str) -> GpuInfo | None:
        """The GPU `holder` shares with other jobs, if it is a --gpu-mem job."""
        return next((g for g in self.gpus if holder in self._shared.get(g.uuid, {})), None)

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

    def allocate_shared(self, holder: str, uuid: str, mem: int) -> GpuInfo:
        """Put `holder` (a --gpu-mem job's attempt) on the GPU `uuid`, `mem` bytes declared; the
        GPU it gets (CUDA_VISIBLE_DEVICES is its UUID). Raises NotEnoughGpus, holding nothing,
        when that GPU has no room for it (held whole, quarantined, `max_jobs_per_gpu` jobs on it,
        or less undeclared memory than `mem`): the claim chose it from a stale `shared_table`."""
        if mem <= 0:
            raise ValueError(f"{holder}: a shared GPU is asked for with the memory needed, not {mem}")
        if any(holder in held for held in self._shared.values()) or holder in self._holder.values():
            raise ValueError(f"{holder} holds GPUs already")
        gpu = self._by_uuid.get(uuid)
        if gpu is None:
            raise NotEnoughGpus(f"{holder} cannot share GPU {uuid}: it is not one of this worker's GPUs")
        if (why := self._no_room(gpu, mem)) is not None:
            raise NotEnoughGpus(f"{holder} cannot share GPU {gpu.index} ({uuid}): {why}")
        on = self._shared.get(uuid, {})
        self._shared[uuid] = on | {holder: mem}
        return gpu

    def _no_room(self, gpu: GpuInfo, mem: int) -> str | None:
        """Why `gpu` cannot take one more --gpu-mem job declaring `mem` bytes, or None if it can."""
        if self.out_of_use(gpu.uuid):
            return "it is quarantined"
        if gpu.uuid in self._holder:
            return "another job holds it whole"
        on = self._shared.get(gpu.uuid, {})
        if len(on) >= self.max_jobs_per_gpu:
            return f"{len(on)} jobs share it already, the most one GPU takes (gpu_max_jobs)"
        if mem > (undeclared := gpu.memory - sum(on.values())):
            return f"{undeclared} bytes of it are undeclared, fewer than the {mem} asked for"
        return None

    def shared_table(self, free_memory: Mapping[str, int] | None = None) -> list[SharedRoom]:
        """Where a --gpu-mem job could go now: a row for each GPU neither held whole nor
        quarantined with fewer than `max_jobs_per_gpu` jobs on it (a wholly free GPU too), the
        GPUs already shared first, then the free ones, each by index. `free_memory` is what NVML
        sees free by UUID (`MemoryProbe.free_memory`; a GPU it leaves out counts its declared
        memory alone)."""
        rows = []
        for g in self.gpus:
            on = self._shared.get(g.uuid, {})
            if g.uuid in self._holder or self.out_of_use(g.uuid) or len(on) >= self.max_jobs_per_gpu:
                continue
            avail = g.memory - sum(on.values())
            if free_memory is not None and g.uuid in free_memory:
                avail = min(avail, free_memory[g.uuid])
            rows.append((not on, SharedRoom(g.index, g.uuid, max(0, avail), self.max_jobs_per_gpu - len(on))))
        rows.sort(key=lambda row: (row[0], row[1].index))  # stable: MIG devices of a GPU in order
        return [room for _free, room in rows]

    def shares(self) -> list[GpuShare]:
        """How many --gpu-mem jobs share each GPU and the memory they declared, for the metrics."""
        return [
            GpuShare(g.uuid, len(on := self._shared.get(g.uuid, {})), sum(on.values())) for g in self.gpus
        ]

    def release(self, holder: str) -> None:
        """Give back every GPU `holder` holds, whole or shared (quarantined ones stay out of use)."""
        for uuid in [u for u, h in self._holder.items() if h == holder]:
            del self._holder[uuid]
        for uuid in [u for u, on in self._shared.items() if holder in on]:
            on = self._shared[uuid]
            del on[holder]
            if not on:
                del self._shared[uuid]

    def quarantine(self, uuid: str, reason: str) -> None:
        if uuid not in self.quarantined:
            log.error("GPU %s quarantined: %s; it is not handed out until it is clean", uuid, reason)
        self.quarantined[uuid] = reason

    def unquarantine(self, uuid: str) -> None:
        if self.quarantined.pop(uuid, None) is not None:
            log.info("GPU %s is clean again and back in use", uuid)

    def mark_unhealthy(self, uuid: str, reason: str) -> None:
        """A health fault takes the GPU out of use (its job, if any, keeps it until it ends)."""
        self.unhealthy[uuid] = reason

    def mark_healthy(self, uuid: str) -> None:
        """The GPU passed its health check: back in use, unless it is also left dirty."""
        self.unhealthy.pop(uuid, None)

    def describe(self) -> list[dict[str, Any]]:
        """The GPUs for the worker's registration: each with its holder, the --gpu-mem jobs that
        share it with the memory each declared, and why it is out of use (a health fault first)."""
        return [
            g.to_dict()
            | {
                "job": self._holder.get(g.uuid, ""),
                "shared": dict(on := self._shared.get(g.uuid, {})),
                "shared_memory": sum(on.values()),
                "quarantined": self.unhealthy.get(g.uuid) or self.quarantined.get(g.uuid, ""),
            }
            for g in self.gpus
        ]


async def recheck_quarantine(allocator: GpuAllocator, probe: GpuProbe, asks: GpuAsks[set[int]]) -> bool:
    """Put back into use each quarantined GPU no process holds memory on any more (it is clean);
    whether any came back. A GPU out for its health is not asked (its NVML may hang: the health
    watch brings it back, then this runs again); the others are asked through `asks` (the
    worker's one for this: a GPU whose last ask still hangs is not asked again, however many
    jobs end meanwhile), NVML_READ_SECONDS at most (one that does not answer stays quarantined;
    the log says NVML does not answer only once the ask has hung: one pending, asked a moment
    before by another check, may yet answer, and that check then says what it found)."""
    uuids = [u for u in allocator.quarantined if u not in allocator.unhealthy]
    asked = await asks.ask({u: functools.partial(probe.compute_pids, u) for u in uuids})
    back = False
    now = time.monotonic()
    for uuid, ask in asked.items():
        if not ask.answer.done():
            if ask.hung(now):
                log.warning("GPU %s stays quarantined: NVML does not answer for it", uuid)
            continue
        try:
            busy = ask.answer.result()
        except GpuProbeError:
            continue
        if not busy:
            allocator.unquarantine(uuid)
            back = True
    return back
