"""The GPUs' readings a worker's heartbeats carry (worker/gpu_readings.py): taken in a thread, one
at a time, so a hung NVML call never holds the event loop, and the readings only grow old."""

from __future__ import annotations

import asyncio
import threading
import time

from daemon.aio import cancel_and_wait
from daemon.metrics.worker import GpuSample
from daemon.worker.gpu_readings import GpuReadings


async def test_readings_are_taken_in_a_thread_and_a_hung_one_holds_nothing() -> None:
    release, calls = threading.Event(), []

    def sampler() -> list[GpuSample]:
        calls.append(time.monotonic())
        if len(calls) > 1:
            release.wait(10)  # the second reading hangs, as NVML can on a failing GPU
        return [GpuSample("GPU-a", 0.5, 2 * 2**30, 16 * 2**30)]

    readings = GpuReadings(sampler, every=0.05)
    task = asyncio.create_task(readings.run())
    try:
        async with asyncio.timeout(5):
            while not readings.for_gpu("GPU-a"):
                await asyncio.sleep(0.01)
        first = readings.for_gpu("GPU-a")
        assert first["utilization"] == 0.5
        assert first["memory_used"] == 2 * 2**30
        t0 = time.monotonic()
        await asyncio.sleep(0.3)  # the loop runs on while a reading hangs
        assert time.monotonic() - t0 < 0.5
        assert len(calls) == 2  # one reading at a time: the hung one is not joined by others
        assert readings.for_gpu("GPU-a") == first  # it says when it was taken
        assert readings.for_gpu("GPU-b") == {}
    finally:
        release.set()
        await cancel_and_wait(task)


async def test_no_sampler_no_readings() -> None:
    readings = GpuReadings(None, every=0.01)
    await asyncio.wait_for(readings.run(), 1)
    assert readings.for_gpu("GPU-a") == {}
