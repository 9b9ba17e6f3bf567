"""The small charts of a GPU's recent utilisation and memory, as SVG polyline points.

Drawn by the server as plain SVG attributes: the Content-Security-Policy allows no inline style
and no script from anywhere but this server, and a chart needs neither.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def bar(fraction: float | None) -> float:
    """The width of a bar filled to `fraction` (0-1) of the chart's width."""
    return round(min(1.0, max(0.0, fraction or 0.0)) * WIDTH, 1)
