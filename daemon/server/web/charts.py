"""The small charts of a GPU's recent utilisation and memory, as SVG polyline points, and of what a
job's GPUs did over its life, as bars.

Drawn by the server as plain SVG attributes: the Content-Security-Policy allows no inline style
and no script from anywhere but this server, and a chart needs neither.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from daemon.server.web.snapshot import Reading

WIDTH, HEIGHT = 120, 28


def utilization_points(readings: Sequence[Reading]) -> str:
    return _points([r.utilization for r in readings])


def memory_points(readings: Sequence[Reading]) -> str:
    return _points(
        [
            r.memory_used / r.memory_total if r.memory_used is not None and r.memory_total else None
            for r in readings
        ]
    )


def _points(values: Sequence[float | None]) -> str:
    """The readings as 'x,y' pairs across the chart, the newest at the right; gaps are skipped."""
    known = [(i, v) for i, v in enumerate(values) if v is not None]
    if len(known) < 2:  # one point draws no line: the page shows a bar instead
        return ""
    step = WIDTH / max(1, len(values) - 1)
    return " ".join(f"{i * step:.1f},{HEIGHT - min(1.0, max(0.0, v)) * HEIGHT:.1f}" for i, v in known)


def usage_bars(usage: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Each GPU of a job's `gpu_usage` (worker/gpu_usage.py) as the job page draws it: a bar to its
    mean utilisation and a mark at its 95th percentile, with the figures they stand for."""
    out = []
    for g in (usage or {}).get("gpus") or []:
        mean, p95 = g.get("util_mean"), g.get("util_p95")
        out.append(
            {
                **g,
                "mean_bar": bar(None if mean is None else mean / 100),
                "p95_x": bar(None if p95 is None else p95 / 100),
            }
        )
    return out


def bar(fraction: float | None) -> float:
    """The width of a bar filled to `fraction` (0-1) of the chart's width."""
    return round(min(1.0, max(0.0, fraction or 0.0)) * WIDTH, 1)
