"""A job's process tree: sampled while it runs (its peak RSS, and every descendant's pid), and
what it left behind once its first process has ended (processes, GPU memory: leftovers.py).

Apart from runner.py, which starts and stops the sampling and asks at the job's end: the samples
are this tree's own state. Sampled: a kernel high-water mark per tree does not exist.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import psutil

from daemon.aio import cancel_and_wait
from daemon.worker import leftovers
from daemon.worker.gpus import GpuInfo, GpuProbe
from daemon.worker.nvml_asks import GpuAsks

SAMPLE_SECONDS = 0.5  # RSS sampling period


class JobTree:
    """One job's tree, sampled from `start` to `stop`; not at all when it is not started (a job
    that ends soon is not sampled: a scan is not free)."""

    def __init__(self, name: str) -> None:
        self.name = name  # the sampling task's
        self.peak_rss = 0
        self.descendants: dict[int, float] = {}  # pid -> create time, of every process seen
        self._task: asyncio.Task[None] | None = None

    def start(self, pgid: int) -> None:
        """Sampling of the tree whose first process, its group's and session's leader, is `pgid`."""
        self._task = asyncio.create_task(self._sample(pgid), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)

    def left(self, pgid: int, killed: Sequence[int] | None) -> list[psutil.Process]:
        """What is left of the job, to wait for: with a cgroup or an identity, all it started has
        been killed by its first process's end (the spawner does it before it says so, and tells
        what is still dying: `killed`). Else (None) it is found, and killed, from /proc."""
        if killed is not None:
            return leftovers.processes(killed)
        return leftovers.leftovers(pgid, self.descendants)

    async def dirty_gpus(
        self, pgid: int, probe: GpuProbe | None, gpus: Sequence[GpuInfo], asks: GpuAsks[set[int]]
    ) -> dict[str, str]:
        """GPUs on which a process of the job still holds memory (leftovers.check_gpus, asking
        through `asks`)."""
        if not gpus or probe is None:
            return {}
        return await leftovers.check_gpus(probe, gpus, set(self.descendants) | {pgid}, pgid, asks)

    async def _sample(self, pgid: int) -> None:
        while True:
            rss, seen = await asyncio.to_thread(leftovers.tree, pgid)
            self.peak_rss = max(self.peak_rss, rss)
            self.descendants.update(seen)
            await asyncio.sleep(SAMPLE_SECONDS)
