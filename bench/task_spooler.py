"""task-spooler (`tsp`), the plainest local job queue, measured as the pool is: where installed.

Each measurement runs a private tsp server (its own TS_SOCKET and TMPDIR, killed afterwards), so
a user's own tsp queue is never touched. Debian's package is `task-spooler`; the bench installs
nothing by itself.

- `drain(jobs, slots)`: `jobs` `true` commands queued behind a blocker job while the server has
  one slot, then `tsp -S slots` and the blocker released: jobs/s from the release until the last
  job has ended (`tsp -w`, then the list checked for anything unfinished).
- `latency(jobs, gap, start)`: on an idle server, `tsp date +%s%N` one at a time, `gap` apart
  (the first at `start`, on CLOCK_MONOTONIC): from just before the `tsp` client is started (the
  CLI is how it is submitted) to the time the job prints as its first act, on the same clock
  (CLOCK_REALTIME). `python -m bench.task_spooler JOBS GAP START` runs it in a process of its own
  and prints the list as JSON (bench/latency.py interleaves it with the pool's submissions).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

TSP = shutil.which("tsp")
# Each job tsp has queued holds a client process and a connection to its server, which serves at
# most 1000 (Debian's build; TS_MAXCONN cannot raise it): a drain queues at most this many.
MAX_QUEUED = 900


@contextlib.contextmanager
def server() -> Iterator[dict[str, str]]:
    """A private tsp server's environment (for `run`); the server is killed on the way out."""
    with tempfile.TemporaryDirectory(prefix="bench-tsp-") as d:
        env = {**os.environ, "TS_SOCKET": f"{d}/socket", "TMPDIR": d, "TS_MAXFINISHED": "100000"}
        try:
            yield env
        finally:
            subprocess.run([TSP or "tsp", "-K"], env=env, capture_output=True, timeout=10, check=False)


def run(env: dict[str, str], *args: str) -> str:
    assert TSP is not None
    return subprocess.run(
        [TSP, *args], env=env, capture_output=True, text=True, timeout=60, check=True
    ).stdout


def drain(jobs: int, slots: int) -> dict[str, float]:
    with server() as env:
        run(env, "-S", "1")
        fifo = Path(env["TMPDIR"]) / "go"
        os.mkfifo(fifo)
        run(env, "sh", "-c", f"read x < {fifo}")
        last = ""
        for _ in range(jobs):
            last = run(env, "true").strip()
        run(env, "-S", str(slots))
        t0 = time.perf_counter()
        fifo.write_text("go\n")  # the blocker ends: the slots fill from the queue
        run(env, "-w", last)
        deadline = time.monotonic() + 60
        while any(w in run(env, "-l") for w in (" running ", " queued ")):
            if time.monotonic() > deadline:
                raise RuntimeError("task-spooler did not finish its jobs within a minute")
            time.sleep(0.001)
        span = time.perf_counter() - t0
    return {"jobs": jobs, "seconds": span, "jobs_per_s": jobs / span}


def latency(jobs: int, gap: float, start: float | None = None) -> list[float]:
    """Seconds from submit to the job's first act, one per job, submitted `gap` apart from `start`
    (time.monotonic(); None: now)."""
    out = []
    with server() as env:
        run(env, "-S", "2")
        first = time.monotonic() if start is None else start
        for i in range(jobs):
            time.sleep(max(0.0, first + i * gap - time.monotonic()))
            t0 = time.time_ns()
            job = run(env, "date", "+%s%N").strip()
            run(env, "-w", job)
            started = int(Path(run(env, "-o", job).strip()).read_text().split()[0])
            out.append((started - t0) / 1e9)
    return out


if __name__ == "__main__":
    print(json.dumps(latency(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]))))
