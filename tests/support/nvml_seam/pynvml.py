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
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

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
            return gpu
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
    used = int(_reading(gpu, "mem_used") or 0)
    return SimpleNamespace(total=gpu.total, used=used, free=gpu.total - used)


def nvmlDeviceGetMinorNumber(gpu: _Gpu) -> int:
    return _DEVICES.index(gpu)  # /dev/nvidiaN, as the driver numbers them: none exists for these


def nvmlDeviceGetMigMode(gpu: _Gpu) -> list[int]:
    raise NVMLError_NotSupported()  # type: ignore[name-defined]  # noqa: F821 (the real module's)


def nvmlDeviceGetComputeRunningProcesses(gpu: _Gpu) -> list[object]:
    return []


def nvmlDeviceGetGraphicsRunningProcesses(gpu: _Gpu) -> list[object]:
    return []


def nvmlDeviceGetUtilizationRates(gpu: _Gpu) -> SimpleNamespace:
    return SimpleNamespace(gpu=int(_reading(gpu, "util") or 0), memory=0)


def nvmlDeviceGetPowerUsage(gpu: _Gpu) -> int:
    if (watts := _reading(gpu, "power_w")) is None:
        raise NVMLError_NotSupported()  # type: ignore[name-defined]  # noqa: F821 (the real module's)
    return int(watts * 1000)  # milliwatts, as NVML gives it


def nvmlDeviceGetTotalEnergyConsumption(gpu: _Gpu) -> int:
    if (energy := _reading(gpu, "energy_mj")) is None:
        raise NVMLError_NotSupported()  # type: ignore[name-defined]  # noqa: F821 (the real module's)
    return int(energy)


def nvmlDeviceGetTemperature(gpu: _Gpu, sensor: int) -> int:
    return 40
