"""GPU discovery (daemon/worker/gpus.py Nvml) against a made-up NVML: pynvml's functions replaced by
a small model of a machine's GPUs, some in MIG mode, so that every layout is tried without a GPU."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml
import pytest

from daemon.worker import gpus
from daemon.worker.gpus import GpuAllocator, GpuInfo

G = 2**30


@dataclass
class FakeDevice:
    """A GPU, or a MIG device on one. `mig` is None for a GPU without MIG support (its mode query
    says NotSupported); the slots of `migs` are the MIG devices by index, None for an empty one."""

    uuid: str
    name: str
    total: int
    used: int = 0
    mig: bool | None = None
    migs: list[FakeDevice | None] = field(default_factory=list)
    minor: int | None = None  # its /dev/nvidiaN (a GPU's; a MIG device has none of its own)


class FakeNvml:
    """pynvml's device functions over a list of FakeDevice; handles are the devices themselves."""

    def __init__(self, devices: list[FakeDevice], monkeypatch: pytest.MonkeyPatch) -> None:
        self.devices = devices
        for name in dir(self):
            if name.startswith("nvml"):
                monkeypatch.setattr(pynvml, name, getattr(self, name))

    def all(self) -> list[FakeDevice]:
        return [d for top in self.devices for d in (top, *(m for m in top.migs if m is not None))]

    def nvmlInit(self) -> None:  # pynvml's names, as they are
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeDevice:
        return self.devices[i]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeDevice:
        for d in self.all():
            if d.uuid == uuid:
                return d
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, d: FakeDevice) -> bytes:
        return d.uuid.encode()  # as nvidia-ml-py before 11.5 did

    def nvmlDeviceGetName(self, d: FakeDevice) -> str:
        return d.name

    def nvmlDeviceGetMemoryInfo(self, d: FakeDevice) -> SimpleNamespace:
        return SimpleNamespace(total=d.total, used=d.used, free=d.total - d.used)

    def nvmlDeviceGetMinorNumber(self, d: FakeDevice) -> int:
        if d.minor is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return d.minor

    def nvmlDeviceGetMigMode(self, d: FakeDevice) -> list[int]:
        if d.mig is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [int(d.mig), int(d.mig)]

    def nvmlDeviceGetMaxMigDeviceCount(self, d: FakeDevice) -> int:
        return len(d.migs)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, d: FakeDevice, i: int) -> FakeDevice:
        if i >= len(d.migs):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if (mig := d.migs[i]) is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return mig


def plain(i: int, mig: bool | None = None) -> FakeDevice:
    return FakeDevice(f"GPU-{i}", "NVIDIA H100 80GB HBM3", 80 * G, mig=mig, minor=i)


def instance(gpu: int, i: int, size: int) -> FakeDevice:
    return FakeDevice(f"MIG-{gpu}-{i}", f"NVIDIA H100 80GB HBM3 MIG {size // 10}g.{size}gb", size * G)


def test_plain_gpus_are_listed_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml([plain(0), plain(1, mig=False)], monkeypatch)  # one without MIG, one with it off
    found, nvml = gpus.discover()
    assert nvml is not None
    assert found == [
        GpuInfo(0, "GPU-0", "NVIDIA H100 80GB HBM3", 80 * G, minor=0),
        GpuInfo(1, "GPU-1", "NVIDIA H100 80GB HBM3", 80 * G, minor=1),
    ]
    nvml.close()


def test_a_mig_gpu_is_listed_as_its_mig_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = plain(0, mig=True)
    gpu.migs = [instance(0, 0, 40), None, instance(0, 2, 20), None]  # empty slots are skipped
    FakeNvml([gpu], monkeypatch)
    found = gpus.Nvml().gpus()
    assert found == [
        GpuInfo(0, "MIG-0-0", "NVIDIA H100 80GB HBM3 MIG 4g.40gb", 40 * G, parent="GPU-0", minor=0),
        GpuInfo(0, "MIG-0-2", "NVIDIA H100 80GB HBM3 MIG 2g.20gb", 20 * G, parent="GPU-0", minor=0),
    ]  # a job on a MIG device opens its GPU's node (/dev/nvidia-caps tells the instances apart)
    assert found[0].to_dict()["parent"] == "GPU-0"
    # each is a GPU to the allocator: whole, by its own UUID, which CUDA_VISIBLE_DEVICES takes
    alloc = GpuAllocator(found, slots=2)
    assert [g.uuid for g in alloc.allocate("a#1", 0, slot=1)] == ["MIG-0-2"]
    assert gpus.visible_devices(alloc.held_by("a#1")) == "MIG-0-2"


def test_mixed_machine_and_a_mig_gpu_without_devices(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="daemon.worker.gpus")
    mig = plain(1, mig=True)
    mig.migs = [instance(1, 0, 10), instance(1, 1, 10)]
    empty = plain(2, mig=True)
    empty.migs = [None] * 7
    FakeNvml([plain(0), mig, empty, plain(3, mig=False)], monkeypatch)
    found, nvml = gpus.discover()
    assert nvml is not None
    assert [(g.index, g.uuid, g.memory, g.parent, g.minor) for g in found] == [
        (0, "GPU-0", 80 * G, None, 0),
        (1, "MIG-1-0", 10 * G, "GPU-1", 1),
        (1, "MIG-1-1", 10 * G, "GPU-1", 1),
        (3, "GPU-3", 80 * G, None, 3),
    ]
    assert any("MIG mode with no MIG device" in r.message for r in caplog.records)
    assert any("MIG device of GPU-1" in r.message for r in caplog.records)
    alloc = GpuAllocator(found, slots=4)  # one each, in order: MIG devices of a GPU stay together
    assert [alloc.allocate(f"j{s}#1", 0, slot=s)[0].uuid for s in range(4)] == [
        "GPU-0",
        "MIG-1-0",
        "MIG-1-1",
        "GPU-3",
    ]
    nvml.close()


def test_free_memory_is_read_by_uuid_and_an_unknown_gpu_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = plain(0)
    gpu.used = 30 * G
    mig = plain(1, mig=True)
    mig.migs = [FakeDevice("MIG-1-0", "MIG 1g.10gb", 10 * G, used=G)]
    FakeNvml([gpu, mig], monkeypatch)
    nvml = gpus.Nvml()
    free = nvml.free_memory(["GPU-0", "MIG-1-0", "GPU-gone"])
    assert free == {"GPU-0": 50 * G, "MIG-1-0": 9 * G}
    alloc = GpuAllocator(nvml.gpus(), slots=4)
    alloc.allocate_shared("a#1", "GPU-0", 20 * G)
    assert [(r.uuid, r.avail) for r in alloc.shared_table(free)] == [("GPU-0", 50 * G), ("MIG-1-0", 9 * G)]
