"""The function the Python API's round trip runs (bench/python_api.py), in a module of its own so
that the job that runs it imports nothing but this: what it costs to start is the system's, not
the bench's imports."""

from __future__ import annotations

import os
import time


def trivial(x: int) -> tuple[int, float, float]:
    """x + 1, the wall clock when it ran (the job's first act, seen by the caller), and when the
    process that runs it started (Linux's /proc, to the clock tick: 10 ms)."""
    ran = time.time()
    with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
        ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        age = float(uptime.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    return x + 1, ran, ran - age
