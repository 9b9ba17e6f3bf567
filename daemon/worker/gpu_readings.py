"""Each GPU's utilisation and memory as of a few seconds ago, for the worker's registration.

The dashboard draws every worker's GPUs from what their heartbeats say (server/web/), so the
worker reads its GPUs once per heartbeat interval and the next heartbeat carries the readings.
NVML calls block, and can hang on a failing GPU: each reading is taken in a daemon thread of its
own, one at a time, so a hung one holds one thread, never the exit, and the readings simply grow
old (each says when it was taken); the event loop, and so the heartbeat, never waits for one.
Each reading is also handed, in the loop, to `on_reading`: the worker's running attempts keep their
own GPUs' summaries from it (gpu_usage.py) and notice GPUs left idle (idle_gpus.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from daemon.aio import in_daemon_thread
from daemon.metrics.worker import GpuSample, GpuSampler

log = logging.getLogger(__name__)


class GpuReadings:
    """`run()` reads the GPUs every `every` seconds until cancelled; `for_gpu(uuid)` is the latest
    reading of one GPU as registration fields (empty before the first, or with no sampler).
    `on_reading(samples, at)` is called with each reading, `at` its time.time()."""

    def __init__(
        self,
        sampler: GpuSampler | None,
        every: float,
        on_reading: Callable[[Sequence[GpuSample], float], None] | None = None,
    ) -> None:
        self._sampler = sampler
        self._every = every
        self._on_reading = on_reading
        self._latest: dict[str, dict[str, Any]] = {}

    def for_gpu(self, uuid: str) -> dict[str, Any]:
        return self._latest.get(uuid, {})

    async def run(self) -> None:
        if self._sampler is None:
            return
        while True:
            try:
                samples = await in_daemon_thread(self._sampler, "gpupool-gpu-readings")
            except Exception as exc:  # noqa: BLE001 - a driver's error: readings grow old, the worker goes on
                log.warning("cannot read the GPUs' utilisation and memory: %s", exc)
            else:
                at = time.time()
                self._latest = {
                    s.uuid: {
                        "utilization": s.utilization,
                        "memory_used": s.memory_used,
                        "memory_total": s.memory_total,
                        "read_at": at,
                    }
                    for s in samples
                }
                if self._on_reading is not None:
                    self._on_reading(samples, at)
            await asyncio.sleep(self._every)
