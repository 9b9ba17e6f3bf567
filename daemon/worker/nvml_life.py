"""NVML's start (the worker's discovery of its GPUs) and close, each within a bound.

Both may hang on a GPU whose driver stopped answering. Run on the event loop's default executor
(asyncio.to_thread), a hung one would hold the process for good: asyncio.run waits for that
executor's threads at the exit. So each runs in a daemon thread of its own (nvml_asks.bounded),
waited for within a bound. Apart from gpus.py, which bench/gpu/health_check.py takes to a bare GPU
machine: this module names the daemon's errors.
"""

from __future__ import annotations

import logging

from daemon.errors import GpupoolError
from daemon.worker.gpus import GpuInfo, Nvml, discover
from daemon.worker.nvml_asks import bounded

log = logging.getLogger(__name__)

# How long the worker waits for NVML to start and list its GPUs (`discover_within`): a machine
# whose driver is not kept loaded (no persistence daemon) may take seconds per GPU to initialise.
NVML_START_SECONDS = 60.0
# How long the worker's stop waits for NVML to close: past it, the process's exit frees it.
NVML_CLOSE_SECONDS = 5.0


async def discover_within(seconds: float = NVML_START_SECONDS) -> tuple[list[GpuInfo], Nvml | None]:
    """`discover`, in a daemon thread of its own, for `seconds` at most: NVML hung on a GPU whose
    driver stopped answering fails the worker's start with a GpupoolError that says so."""
    try:
        return await bounded(discover, "gpupool-gpu-discover", seconds)
    except TimeoutError:
        raise GpupoolError(
            f"NVML did not list this machine's GPUs in {seconds:g} s: a GPU's driver has stopped "
            "answering (nvidia-smi should hang too); reset the GPU or reboot, then start the worker"
        ) from None


async def close_within(nvml: Nvml, seconds: float = NVML_CLOSE_SECONDS) -> None:
    """`nvml.close()`, in a daemon thread of its own, for `seconds` at most: NVML hung on a GPU
    does not hold the worker's stop (the process's exit frees it)."""
    try:
        await bounded(nvml.close, "gpupool-nvml-close", seconds)
    except TimeoutError:
        log.warning("NVML not closed in %g s (a GPU's driver stopped answering); left to the exit", seconds)
