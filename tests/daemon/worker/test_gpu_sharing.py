"""GPU sharing (poolctl enqueue --gpu-mem, issue 17 item 4): the allocator's rules, through the seam
of a made-up GPU list and made-up NVML free-memory readings (plain dicts)."""

from __future__ import annotations

import pytest

from daemon.job import JobSpec, Lease
from daemon.metrics.worker import GpuShare
from daemon.worker.gpus import GpuAllocator, GpuInfo, NotEnoughGpus, SharedRoom, visible_devices
from daemon.worker.run_types import job_env
from tests.support.workers import fake_gpus

G = 2**30


def big_gpus(n: int) -> list[GpuInfo]:
    """`n` made-up 80 GiB GPUs."""
    return [GpuInfo(i, f"GPU-{i:08d}-fake", "Fake GPU 80GB", 80 * G) for i in range(n)]


def uuid(i: int) -> str:
    return f"GPU-{i:08d}-fake"


def test_two_20g_jobs_share_an_80g_gpu_and_a_third_asking_too_much_does_not_fit() -> None:
    alloc = GpuAllocator(big_gpus(1), slots=4)
    assert alloc.allocate_shared("a#1", uuid(0), 20 * G).uuid == uuid(0)
    assert alloc.allocate_shared("b#1", uuid(0), 20 * G).index == 0
    assert alloc.shared_table() == [SharedRoom(0, uuid(0), 40 * G, 2)]
    with pytest.raises(NotEnoughGpus, match="fewer than"):
        alloc.allocate_shared("c#1", uuid(0), 41 * G)
    assert alloc.shared_table() == [SharedRoom(0, uuid(0), 40 * G, 2)]  # a refusal holds nothing
    # NVML sees less free than was left undeclared (a job uses more than it said): the least counts
    assert alloc.shared_table({uuid(0): 30 * G}) == [SharedRoom(0, uuid(0), 30 * G, 2)]
    assert alloc.shared_table({uuid(0): 70 * G}) == [SharedRoom(0, uuid(0), 40 * G, 2)]
    assert alloc.shared_table({"GPU-other": 1}) == [SharedRoom(0, uuid(0), 40 * G, 2)]
    alloc.release("a#1")
    assert alloc.shared_table() == [SharedRoom(0, uuid(0), 60 * G, 3)]
    assert alloc.shared_by("b#1") == big_gpus(1)[0]
    assert alloc.shared_by("a#1") is None


def test_a_shared_gpu_is_never_handed_out_whole_and_a_whole_one_never_shared() -> None:
    alloc = GpuAllocator(big_gpus(2), slots=2)  # each slot's share: 1 GPU
    alloc.allocate_shared("small#1", uuid(1), 10 * G)
    assert [g.index for g in alloc.free()] == [0]
    assert [g.index for g in alloc.allocate("whole#1", 0, slot=1)] == [0]  # its home (1) is shared
    with pytest.raises(NotEnoughGpus):
        alloc.allocate("whole#2", 1, slot=0)
    with pytest.raises(NotEnoughGpus, match="holds it whole"):
        alloc.allocate_shared("small#2", uuid(0), 1)
    assert [r.uuid for r in alloc.shared_table()] == [uuid(1)]  # the whole one is no row
    assert alloc.held_by("whole#1") == [big_gpus(2)[0]]
    assert alloc.held_by("small#1") == []  # held_by names GPUs held whole only
    alloc.release("small#1")
    assert [g.index for g in alloc.allocate("whole#2", 1, slot=0)] == [1]  # free again: whole
    alloc.release("whole#1")
    alloc.release("whole#2")
    assert alloc.free_count() == 2


def test_the_per_gpu_cap_counts_jobs_whatever_their_memory() -> None:
    alloc = GpuAllocator(big_gpus(2), slots=8, max_jobs_per_gpu=3)
    for n in range(3):
        alloc.allocate_shared(f"j{n}#1", uuid(0), 1 * G)
    with pytest.raises(NotEnoughGpus, match="3 jobs share it already"):
        alloc.allocate_shared("j3#1", uuid(0), 1 * G)
    assert alloc.shared_table() == [SharedRoom(1, uuid(1), 80 * G, 3)]  # the full GPU is no row
    alloc.release("j1#1")
    assert alloc.shared_table()[0] == SharedRoom(0, uuid(0), 78 * G, 1)
    with pytest.raises(ValueError, match="at least 1"):
        GpuAllocator(big_gpus(1), slots=1, max_jobs_per_gpu=0)


def test_shared_gpus_come_first_so_that_jobs_pack_then_free_ones_by_index() -> None:
    alloc = GpuAllocator(big_gpus(4), slots=8)
    assert [r.index for r in alloc.shared_table()] == [0, 1, 2, 3]
    alloc.allocate_shared("a#1", uuid(2), 10 * G)
    alloc.allocate_shared("b#1", uuid(3), 70 * G)
    alloc.allocate("whole#1", 1, slot=0)  # takes GPU 0
    table = alloc.shared_table({uuid(1): 79 * G})
    assert table == [
        SharedRoom(2, uuid(2), 70 * G, 3),
        SharedRoom(3, uuid(3), 10 * G, 3),
        SharedRoom(1, uuid(1), 79 * G, 4),
    ]


def test_quarantined_gpus_are_neither_shared_nor_listed_and_their_jobs_may_finish() -> None:
    alloc = GpuAllocator(big_gpus(2), slots=4)
    alloc.allocate_shared("a#1", uuid(0), 10 * G)
    alloc.quarantine(uuid(0), "memory still held")
    alloc.quarantine(uuid(1), "cannot check it")
    assert alloc.shared_table() == []
    for gpu in (0, 1):
        with pytest.raises(NotEnoughGpus, match="quarantined"):
            alloc.allocate_shared("b#1", uuid(gpu), 1)
    assert alloc.shared_by("a#1") is not None  # the job already on it runs on
    alloc.release("a#1")
    assert alloc.free_count() == 0
    alloc.unquarantine(uuid(0))
    assert alloc.shared_table() == [SharedRoom(0, uuid(0), 80 * G, 4)]
    assert alloc.free_count() == 1


def test_bad_requests_are_refused_saying_why() -> None:
    alloc = GpuAllocator(big_gpus(1), slots=2)
    with pytest.raises(NotEnoughGpus, match="not one of this worker's GPUs"):
        alloc.allocate_shared("a#1", "GPU-elsewhere", G)
    with pytest.raises(ValueError, match="memory needed"):
        alloc.allocate_shared("a#1", uuid(0), 0)
    alloc.allocate_shared("a#1", uuid(0), G)
    with pytest.raises(ValueError, match="already"):
        alloc.allocate_shared("a#1", uuid(0), G)
    cpu = GpuAllocator([], slots=2)
    assert cpu.shared_table() == []
    assert cpu.shares() == []


def test_the_registration_and_the_metrics_show_who_shares_what() -> None:
    alloc = GpuAllocator(fake_gpus(2), slots=2)  # 16 GiB each
    alloc.allocate_shared("a#1", uuid(1), 4 * G)
    alloc.allocate_shared("b#1", uuid(1), 2 * G)
    whole, shared = alloc.describe()
    assert (whole["shared"], whole["shared_memory"], whole["job"]) == ({}, 0, "")
    assert shared["shared"] == {"a#1": 4 * G, "b#1": 2 * G}
    assert (shared["shared_memory"], shared["job"], shared["quarantined"]) == (6 * G, "", "")
    assert "parent" not in shared
    assert alloc.shares() == [GpuShare(uuid(0), 0, 0), GpuShare(uuid(1), 2, 6 * G)]
    alloc.release("a#1")
    alloc.release("b#1")
    assert alloc.shares() == [GpuShare(uuid(0), 0, 0), GpuShare(uuid(1), 0, 0)]
    assert alloc.describe()[1]["shared"] == {}


def test_a_shared_job_sees_its_one_gpu_and_the_memory_it_declared() -> None:
    alloc = GpuAllocator(big_gpus(2), slots=2)
    spec = JobSpec(argv=("true",), gpu_mem=20 * G)
    lease = Lease("default.0000000000000", 1, "w1", spec, "w1/1.0")
    gpu = alloc.allocate_shared(lease.id, uuid(1), spec.gpu_mem)
    env = job_env({"PATH": "/bin"}, lease, (gpu,))
    assert env["CUDA_VISIBLE_DEVICES"] == uuid(1) == visible_devices((gpu,))
    assert env["GPUPOOL_GPU_MEM"] == str(20 * G)
    whole = Lease("default.0000000000001", 1, "w1", JobSpec(argv=("true",), gpus=1), "w1/1.1")
    assert "GPUPOOL_GPU_MEM" not in job_env({}, whole, alloc.allocate(whole.id, 1, slot=0))
