"""Each GPU's utilisation and memory as of a few seconds ago, for the worker's registration and
its metrics.

The dashboard draws every worker's GPUs from what their heartbeats say (server/web/), so the
worker reads its GPUs once per heartbeat interval and the next heartbeat carries the readings; the
metrics endpoint serves the same latest readings (`samples`), so a scrape never asks NVML itself.
NVML calls block, and can hang on a failing GPU: each GPU is read in a daemon thread of its own,
within a bound, and not asked again while its last read hangs (nvml_asks.py), so a hung GPU holds
one thread, never the exit nor the other GPUs' readings: its own reading simply grows old (each
says when it was taken); the event loop, and so the heartbeat, never waits for one.
Each pass's fresh readings are also handed, in the loop, to `on_reading`: the worker's running
attempts keep their own GPUs' summaries from them (gpu_usage.py) and notice GPUs left idle
(idle_gpus.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from daemon.metrics.worker import GpuSample, GpuSampler
from daemon.worker.nvml_asks import GpuAsks

log = logging.getLogger(__name__)


class GpuReadings:
    """`run()` asks each of `readers` (one per GPU where NVML reads them; by name) every `every`
    seconds until cancelled; `for_gpu(uuid)` is the latest reading of one GPU as registration
    fields (empty before the first, or with no reader), `samples()` the latest of every GPU.
    `on_reading(samples, at)` is called with each pass's fresh readings, `at` their time.time()."""

    def __init__(
        self,
        readers: Mapping[str, GpuSampler],
        every: float,
        on_reading: Callable[[Sequence[GpuSample], float], None] | None = None,
    ) -> None:
        self._readers = dict(readers)
        self._every = every
        self._on_reading = on_reading
        self._asks: GpuAsks[Sequence[GpuSample]] = GpuAsks("gpupool-gpu-readings")
        # Each reader's latest samples and their time.time(), replaced whole when it answers.
        self._read: dict[str, tuple[Sequence[GpuSample], float]] = {}
        self._latest: dict[str, dict[str, Any]] = {}
        self._samples: tuple[GpuSample, ...] = ()

    def for_gpu(self, uuid: str) -> dict[str, Any]:
        return self._latest.get(uuid, {})

    def samples(self) -> Sequence[GpuSample]:
        """The latest sample of each GPU read (safe from any thread: the metrics' collection)."""
        return self._samples

    async def run(self) -> None:
        if not self._readers:
            return
        while True:
            asks = await self._asks.ask(self._readers)
            at = time.time()
            fresh: list[GpuSample] = []
            answered = False
            for name, ask in asks.items():
                if not ask.answer.done():
                    continue  # still hanging: its readings grow old
                try:
                    samples = ask.answer.result()
                except Exception as exc:  # noqa: BLE001 - a driver's error: readings grow old, the worker goes on
                    log.warning("cannot read the utilisation and memory of %s: %s", name, exc)
                    continue
                self._read[name] = (samples, at)
                fresh += samples
                answered = True
            self._latest = {
                s.uuid: {
                    "utilization": s.utilization,
                    "memory_used": s.memory_used,
                    "memory_total": s.memory_total,
                    "read_at": read_at,
                }
                for samples, read_at in self._read.values()
                for s in samples
            }
            self._samples = tuple(s for samples, _ in self._read.values() for s in samples)
            if self._on_reading is not None and answered:
                self._on_reading(fresh, at)
            await asyncio.sleep(self._every)
