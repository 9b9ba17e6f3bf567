"""GPU memory packing on a real worker (the NVML seam: a made-up 80 GiB GPU): two --gpu-mem jobs
share it, each seeing it in CUDA_VISIBLE_DEVICES, and a third waits until one ends: for want of
memory (30 GiB jobs), or of room under the cap of jobs per GPU (20 GiB jobs, gpu_max_jobs 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.job import JobSpec, JobState
from daemon.queue.job_queue import JobQueue
from daemon.worker.gpus import GpuInfo
from tests.support.workers import running_worker, sh, wait_file, wait_state

GIB = 2**30


@pytest.mark.parametrize(("gib", "cap"), [(30, 4), (20, 2)])
async def test_two_jobs_share_an_80g_gpu_and_a_third_waits(
    queue: JobQueue, tmp_path: Path, gib: int, cap: int
) -> None:
    log, go = tmp_path / "log", tmp_path / "go"
    gpu = GpuInfo(0, "GPU-00000000-big-fake", "Fake 80 GiB GPU", 80 * GIB)

    def job(name: str) -> JobSpec:
        wait = f"while [ ! -e {go} ]; do sleep 0.02; done"
        return sh(f'echo "{name} $CUDA_VISIBLE_DEVICES $GPUPOOL_GPU_MEM" >> {log}; {wait}', gpu_mem=gib * GIB)

    async with running_worker(queue, tmp_path / "w", gpus=[gpu], slots=3, gpu_max_jobs=cap) as worker:
        ids = [(await queue.enqueue(job(f"job{i}")))[0] for i in range(3)]
        assert sorted(await wait_file(log, 2)) == [f"job{i} {gpu.uuid} {gib * GIB}" for i in range(2)]
        assert (await queue.get(ids[2])).state is JobState.QUEUED  # no room: memory, or the cap
        assert worker.allocator.free() == []  # shared, so not free whole
        go.touch()
        for job_id in ids:
            await wait_state(queue, job_id, JobState.SUCCEEDED)
    assert log.read_text().splitlines()[2] == f"job2 {gpu.uuid} {gib * GIB}"
