"""GPU memory packing on a real worker (the NVML seam: a made-up 80 GiB GPU): two --gpu-mem jobs
of 30 GiB share it, each seeing it in CUDA_VISIBLE_DEVICES, and a third waits until one ends."""

from __future__ import annotations

from pathlib import Path

from daemon.job import JobSpec, JobState
from daemon.queue.job_queue import JobQueue
from daemon.worker.gpus import GpuInfo
from tests.support.workers import running_worker, sh, wait_file, wait_state

GIB = 2**30


async def test_two_30g_jobs_share_an_80g_gpu_and_a_third_waits(queue: JobQueue, tmp_path: Path) -> None:
    log, go = tmp_path / "log", tmp_path / "go"
    gpu = GpuInfo(0, "GPU-00000000-big-fake", "Fake 80 GiB GPU", 80 * GIB)

    def job(name: str) -> JobSpec:
        wait = f"while [ ! -e {go} ]; do sleep 0.02; done"
        return sh(f'echo "{name} $CUDA_VISIBLE_DEVICES $GPUPOOL_GPU_MEM" >> {log}; {wait}', gpu_mem=30 * GIB)

    async with running_worker(queue, tmp_path / "w", gpus=[gpu], slots=3) as worker:
        ids = [(await queue.enqueue(job(f"job{i}")))[0] for i in range(3)]
        assert sorted(await wait_file(log, 2)) == [f"job{i} {gpu.uuid} {30 * GIB}" for i in range(2)]
        assert (await queue.get(ids[2])).state is JobState.QUEUED  # 60 of 80 GiB declared: no room
        assert worker.allocator.free() == []  # shared, so not free whole
        go.touch()
        for job_id in ids:
            await wait_state(queue, job_id, JobState.SUCCEEDED)
    assert log.read_text().splitlines()[2] == f"job2 {gpu.uuid} {30 * GIB}"
