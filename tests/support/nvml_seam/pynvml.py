"""A made-up NVML for worker PROCESSES (the chaos suite's GPU workers): this directory goes first on
a `poold --worker`'s PYTHONPATH, so its `import pynvml` finds this module instead of nvidia-ml-py's,
and the worker discovers, places jobs on and probes GPUs that do not exist. In-process tests use
tests/support/workers.py `fake_gpus` instead; nothing of the product knows this module.

`FAKE_NVML_GPUS` lists the GPUs' memory in GiB, comma-separated ("80,80": two GPUs of 80 GiB);
`FAKE_NVML_HOST` goes into their UUIDs, so that two workers' GPUs never share one.
`FAKE_NVML_READINGS` names a directory where a test (or a job: it may be world-writable) sets a
GPU's readings: a file named after its UUID holding JSON `{"util": percent, "mem_used": bytes,
"power_w": watts, "energy_mj": millijoules}`, each key optional, read afresh at every call;
without one a GPU reads 0 % and no memory in use, and has no power or energy reading. Everything the
worker does not ask of a made-up GPU (errors, constants) is the real module's: it is loaded from
the path that follows this directory, so `pynvml.NVMLError` and its kin are the very classes the
worker catches. No process ever holds memory on these GPUs (the memory in use a test sets is a
reading, no more), and no job leaves one dirty.

`FAKE_NVML_FAULTS` names a JSON file a test writes to give the GPUs health faults at run time (no
file: all healthy), read afresh at each call: `{"0": {...}}` by GPU index, with any of
`"xid": [79, ...]` (Xid events, each delivered once by the event set's wait; a shorter list starts
the count again), `"ecc": N` (uncorrectable volatile ECC errors), `"retired_pending": true`,
`"remap_pending": true`, `"remap_failed": true`, `"clocks": BITS` (clocks event reasons),
`"lost": true` (every call on the GPU says it has fallen off the bus) and `"hang": true` (every call
on the GPU waits, as a driver that stopped answering does, until the file no longer says so).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

_HERE = Path(__file__).resolve().parent
GIB = 2**30


def _real() -> ModuleType:
    """nvidia-ml-py's pynvml, from the rest of sys.path."""
    path = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("pynvml", path)
    if spec is None or spec.loader is None:
        raise ImportError("the made-up NVML needs nvidia-ml-py installed for its errors and constants")
    module = importlib.util.module_from_spec(spec)
    mine = sys.modules[__name__]
    sys.modules[__name__] = module  # it makes its error classes on `sys.modules["pynvml"]`
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules[__name__] = mine
    return module


globals().update({k: v for k, v in vars(_real()).items() if not k.startswith("__")})


class _Gpu(SimpleNamespace):
    uuid: str
    total: int


def _gpus() -> list[_Gpu]:
    host = os.environ.get("FAKE_NVML_HOST", "host")
    sizes = [s for s in os.environ.get("FAKE_NVML_GPUS", "").split(",") if s.strip()]
    return [_Gpu(uuid=f"GPU-fake-{host}-{i}", total=int(float(s) * GIB)) for i, s in enumerate(sizes)]


_DEVICES = _gpus()


def nvmlInit() -> None:
    pass


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(_DEVICES)


def nvmlDeviceGetHandleByIndex(index: int) -> _Gpu:
    return _DEVICES[index]


def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> _Gpu:
    wanted = uuid.decode() if isinstance(uuid, bytes) else uuid
    for gpu in _DEVICES:
        if gpu.uuid == wanted:
            return _answering(gpu)
    raise NVMLError_NotFound()  # type: ignore[name-defined]  # noqa: F821 (the real module's)


def nvmlDeviceGetUUID(gpu: _Gpu) -> str:
    return gpu.uuid


def nvmlDeviceGetName(gpu: _Gpu) -> str:
    return "Made-up GPU"


def _reading(gpu: _Gpu, key: str) -> float | None:
    """The test's reading `key` of `gpu` (FAKE_NVML_READINGS), if it set one."""
    where = os.environ.get("FAKE_NVML_READINGS")
    if not where:
        return None
    try:
        value = json.loads((Path(where) / gpu.uuid).read_text()).get(key)
    except (OSError, ValueError):
        return None
    return None if value is None else float(value)


def nvmlDeviceGetMemoryInfo(gpu: _Gpu) -> SimpleNamespace:
    _answering(gpu)
    used = int(_reading(gpu, "mem_used") or 0)
    return SimpleNamespace(total=gpu.total, used=used, free=gpu.total - used)


def nvmlDeviceGetMinorNumber(gpu: _Gpu) -> int:
    return _DEVICES.index(gpu)  # /dev/nvidiaN, as the driver numbers them: none exists for these


def nvmlDeviceGetMigMode(gpu: _Gpu) -> list[int]:
    raise NVMLError_NotSupported()  # type: ignore[name-defined]  # noqa: F821 (the real module's)


def nvmlDeviceGetComputeRunningProcesses(gpu: _Gpu) -> list[object]:
    _answering(gpu)
    return []


def nvmlDeviceGetGraphicsRunningProcesses(gpu: _Gpu) -> list[object]:
    _answering(gpu)
    return []


def nvmlDeviceGetUtilizationRates(gpu: _Gpu) -> SimpleNamespace:
    _answering(gpu)
    return SimpleNamespace(gpu=int(_reading(gpu, "util") or 0), memory=0)


def nvmlDeviceGetPowerUsage(gpu: _Gpu) -> int:
    _answering(gpu)
    if (watts := _reading(gpu, "power_w")) is None:
        raise NVMLError_NotSupported()  # type: ignore[name-defined]  # noqa: F821 (the real module's)
    return int(watts * 1000)  # milliwatts, as NVML gives it


def nvmlDeviceGetTotalEnergyConsumption(gpu: _Gpu) -> int:
    _answering(gpu)
    if (energy := _reading(gpu, "energy_mj")) is None:
        raise NVMLError_NotSupported()  # type: ignore[name-defined]  # noqa: F821 (the real module's)
    return int(energy)


def nvmlDeviceGetTemperature(gpu: _Gpu, sensor: int) -> int:
    _answering(gpu)
    return 40


# -- health faults (FAKE_NVML_FAULTS) --


def _faults(gpu: _Gpu) -> dict[str, Any]:
    path = os.environ.get("FAKE_NVML_FAULTS")
    if not path:
        return {}
    try:
        with open(path) as f:
            faults = json.load(f)
    except (OSError, ValueError):  # none yet, or caught half written: none this time
        return {}
    found = faults.get(str(_DEVICES.index(gpu)), {})
    return found if isinstance(found, dict) else {}


def _answering(gpu: _Gpu) -> _Gpu:
    while _faults(gpu).get("hang"):  # the file is the only way to let it go: looked at again
        time.sleep(0.05)
    if _faults(gpu).get("lost"):
        raise NVMLError_GpuIsLost()  # type: ignore[name-defined]  # noqa: F821 (the real module's)
    return gpu


def nvmlDeviceGetTotalEccErrors(gpu: _Gpu, error_type: int, counter_type: int) -> int:
    uncorrected = error_type == NVML_MEMORY_ERROR_TYPE_UNCORRECTED  # type: ignore[name-defined]  # noqa: F821
    return int(_faults(_answering(gpu)).get("ecc", 0)) if uncorrected else 0


def nvmlDeviceGetRetiredPagesPendingStatus(gpu: _Gpu) -> int:
    return 1 if _faults(_answering(gpu)).get("retired_pending") else 0


def nvmlDeviceGetRemappedRows(gpu: _Gpu) -> tuple[int, int, int, int]:
    faults = _faults(_answering(gpu))
    return (0, 0, int(bool(faults.get("remap_pending"))), int(bool(faults.get("remap_failed"))))


def nvmlDeviceGetCurrentClocksEventReasons(gpu: _Gpu) -> int:
    return int(_faults(_answering(gpu)).get("clocks", 0))


class _EventSet:
    def __init__(self) -> None:
        self.gpus: list[_Gpu] = []


_delivered: dict[int, int] = {}  # GPU index -> Xids of its list delivered so far
_delivering = threading.Lock()


def nvmlEventSetCreate() -> _EventSet:
    return _EventSet()


def nvmlDeviceRegisterEvents(gpu: _Gpu, event_types: int, events: _EventSet) -> None:
    events.gpus.append(_answering(gpu))


def nvmlEventSetFree(events: _EventSet) -> None:
    pass


def nvmlEventSetWait_v2(events: _EventSet, timeout_ms: int) -> SimpleNamespace:
    """The next Xid of a registered GPU's list not yet delivered; NVMLError_Timeout after
    `timeout_ms` without one."""
    deadline = time.monotonic() + timeout_ms / 1000
    if not os.environ.get("FAKE_NVML_FAULTS"):  # no Xid can come: a worker of other tests' waits
        time.sleep(timeout_ms / 1000)
        raise NVMLError_Timeout()  # type: ignore[name-defined]  # noqa: F821 (the real module's)
    while True:
        with _delivering:
            for gpu in events.gpus:
                _answering(gpu)  # a GPU fallen off the bus fails the wait, as NVML's does
                index = _DEVICES.index(gpu)
                xids = list(_faults(gpu).get("xid", []))
                sent = min(_delivered.get(index, 0), len(xids))
                _delivered[index] = sent
                if sent < len(xids):
                    _delivered[index] = sent + 1
                    return SimpleNamespace(
                        device=gpu,
                        eventType=nvmlEventTypeXidCriticalError,  # type: ignore[name-defined]  # noqa: F821
                        eventData=int(xids[sent]),
                        gpuInstanceId=0xFFFFFFFF,
                        computeInstanceId=0xFFFFFFFF,
                    )
        if time.monotonic() >= deadline:
            raise NVMLError_Timeout()  # type: ignore[name-defined]  # noqa: F821 (the real module's)
        time.sleep(0.02)  # a made-up driver's wait: the file has no way to wake it


def nvmlEventSetWait(events: _EventSet, timeout_ms: int) -> SimpleNamespace:
    return nvmlEventSetWait_v2(events, timeout_ms)
