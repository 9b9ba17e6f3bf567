"""Backfill on a real worker: a 4-GPU head job behind a running one reserves the worker; small jobs
sure to end in time start meanwhile, and a steady stream of them never starves the head."""

from __future__ import annotations

import asyncio
from pathlib import Path

from daemon.job import JobSpec, JobState
from daemon.queue.job_queue import JobQueue
from tests.support.workers import fake_gpus, running_worker, sh, wait_file, wait_state


async def test_a_4_gpu_head_is_never_starved_by_a_stream_of_1_gpu_jobs(
    queue: JobQueue, tmp_path: Path
) -> None:
    starts = tmp_path / "starts"

    def job(name: str, gpus: int, run: float, timeout: float) -> JobSpec:
        return sh(f"echo {name} >> {starts}; sleep {run}", gpus=gpus, timeout=timeout, stop_grace=1)

    first, _ = await queue.enqueue(job("first", 1, 1.0, 4))  # ends within 5 s (its limit and grace)
    async with running_worker(queue, tmp_path / "w", gpus=fake_gpus(4), slots=4):
        await wait_file(starts, 1)
        head, _ = await queue.enqueue(job("head", 4, 0.1, 10))
        stream = []
        for i in range(25):  # a steady stream for 2.5 s: each small job is sure to end within 2 s
            stream.append((await queue.enqueue(job(f"small{i}", 1, 0.2, 1)))[0])
            await asyncio.sleep(0.1)
        for job_id in [first, head, *stream]:
            await wait_state(queue, job_id, JobState.SUCCEEDED)
    order = starts.read_text().split()
    at = order.index("head")
    assert order[0] == "first"
    assert at > 1  # small jobs ran beside the first while the head waited for all 4 GPUs: backfill
    assert at < len(order) - 1  # and the stream did not starve it: it started while small ones came
