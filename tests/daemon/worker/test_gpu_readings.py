"""The GPUs' readings a worker's heartbeats carry (worker/gpu_readings.py): taken in a thread, one
at a time, so a hung NVML call never holds the event loop, and the readings only grow old."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

from daemon.aio import cancel_and_wait
from daemon.metrics.worker import GpuSample
from daemon.worker.gpu_readings import GpuReadings
from tests.support.paths import ROOT


async def test_readings_are_taken_in_a_thread_and_a_hung_one_holds_nothing() -> None:
    release, calls = threading.Event(), []

    def sampler() -> list[GpuSample]:
        calls.append(time.monotonic())
        if len(calls) > 1:
            release.wait(10)  # the second reading hangs, as NVML can on a failing GPU
        return [GpuSample("GPU-a", 0.5, 2 * 2**30, 16 * 2**30)]

    readings = GpuReadings({"GPU-a": sampler}, every=0.05)
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


async def test_no_reader_no_readings() -> None:
    readings = GpuReadings({}, every=0.01)
    await asyncio.wait_for(readings.run(), 1)
    assert readings.for_gpu("GPU-a") == {}


def test_a_hung_reading_does_not_hold_the_daemons_exit(tmp_path: Path) -> None:
    """The reading runs in a daemon thread of its own: asyncio.run's exit waits for the default
    executor's threads, so a reading hung in one would keep the worker from ever exiting."""
    script = tmp_path / "hang.py"
    script.write_text(
        "import asyncio, threading, uvloop\n"
        "from daemon.aio import cancel_and_wait\n"
        "from daemon.worker.gpu_readings import GpuReadings\n"
        "started = threading.Event()\n"
        "def sampler():\n"
        "    started.set()\n"
        "    threading.Event().wait()  # hangs for good, as NVML on a GPU fallen off the bus\n"
        "async def main():\n"
        "    task = asyncio.create_task(GpuReadings({'GPU-a': sampler}, every=0.01).run())\n"
        "    while not started.is_set():\n"
        "        await asyncio.sleep(0.01)\n"
        "    await cancel_and_wait(task)\n"
        "uvloop.run(main())\n"
        "print('exited')\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=30, cwd=ROOT, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "exited"
