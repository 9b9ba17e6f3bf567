"""GPU memory packing on a real worker (the NVML seam: a made-up 80 GiB GPU): two --gpu-mem jobs
share it, each seeing it in CUDA_VISIBLE_DEVICES, and a third waits until one ends: for want of
memory (30 GiB jobs), or of room under the cap of jobs per GPU (20 GiB jobs, gpu_max_jobs 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from daemon.job import JobSpec, JobState
from daemon.queue import accounting, keys
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
        assert worker.gpu_books.allocator.free() == []  # shared, so not free whole
        go.touch()
        for job_id in ids:
            await wait_state(queue, job_id, JobState.SUCCEEDED)
    assert log.read_text().splitlines()[2] == f"job2 {gpu.uuid} {gib * GIB}"


async def test_gpu_mem_jobs_sharing_a_gpu_are_each_charged_their_share_of_it(
    queue: JobQueue, tmp_path: Path
) -> None:
    """issue 50, accounting (review 50b finding 5): two --gpu-mem jobs of 20 GiB share one made-up
    80 GiB GPU for the same time; each one's accounting record charges a quarter of a GPU for
    its run (its memory over the GPU's), not a whole GPU each: together they held one GPU at
    most, and `poolctl acct` counts half of one here."""
    gpu = GpuInfo(0, "GPU-00000000-big-fake", "Fake 80 GiB GPU", 80 * GIB)
    async with running_worker(queue, tmp_path / "w", gpus=[gpu], slots=2):
        ids = [(await queue.enqueue(sh("sleep 0.2", gpu_mem=20 * GIB)))[0] for _ in range(2)]
        for job_id in ids:
            await wait_state(queue, job_id, JobState.SUCCEEDED)
        ran = {}  # job id -> ms its one attempt ran, read before its record goes
        for job_id in ids:
            (attempt,) = [json.loads(a) for a in await queue.redis.lrange(keys.attempts(job_id), 0, -1)]
            ran[job_id] = attempt["ended_at"] - attempt["started_at"]
    day = int((await queue.redis.time())[0] // 86400)
    charged = [int(r[3]) async for page in accounting.read_day(queue.redis, "default", day) for r in page]
    assert sorted(charged) == pytest.approx(sorted(ms / 4 for ms in ran.values()), abs=1)
