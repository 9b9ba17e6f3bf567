"""What the GPU checks share: the worker's GPU code imported on a GPU machine that lacks the
project's venv.

The venv is too big to carry to such a machine: only pynvml travels (in `.devcheck/site`, which
each check puts on sys.path with the checkout, before it imports this). The worker's GPU modules
name daemon/metrics/worker.py, whose psutil, redis and prometheus_client are then missing; nothing
in a check serves or samples metrics, so the names they import from it are stood in for."""

from __future__ import annotations

import dataclasses
import sys
import types


def stand_in_worker_metrics() -> None:
    """Make `daemon.metrics.worker` importable: the real one where the venv is, else a stand-in
    with the names daemon/worker/gpus.py and gpu_health.py import from it."""
    try:
        import daemon.metrics.worker  # noqa: F401 - only to learn whether it imports
    except ImportError:
        stub = types.ModuleType("daemon.metrics.worker")

        @dataclasses.dataclass
        class _Any:
            pass

        stub.GpuSample = stub.GpuShare = _Any  # type: ignore[attr-defined]
        stub.HEALTH_REASONS = ("xid", "ecc", "pages", "lost", "thermal", "power")  # type: ignore[attr-defined]
        sys.modules["daemon.metrics.worker"] = stub
