"""The Python API's round trip (issue 48): a trivial function submitted and its result back in the
caller's hands, through gpupool's Python API beside submitit on Slurm, one machine, one run.

- gpupool: `gpupool.connect()` to a single-machine pool as `make run` starts one (`poold` in a
  process of its own: embedded Redis, its local store, 2 local slots), found through pools.toml as
  a user's is; `pool.submit(trivial, i).result()`. The job runs in a copy of the caller's project
  (this checkout) with its environment, as the API ships them by default.
- gpupool, no project: the same through `gpupool.connect(project=False)`: the job runs in an empty
  directory with the worker's Python. Its difference from the row above is the project's cost.
- submitit: `submitit.SlurmExecutor(folder).submit(trivial, i).result()` on the one-node Slurm the
  tests run (tests/support/slurm.py: Debian's slurm-wlm on loopback, 2 CPUs, the scheduler's
  defaults); its job reads the call from, and writes the result to, a folder both sides see, as on
  a cluster's shared filesystem. `--slurm-no-batch-delay` sets `batch_sched_delay=0` (by default
  Slurm may wait 3 s before it schedules a batch job it was just given).

Both run their jobs as this process's user (root here: the pool with `job_uid_range = "root"`,
as Slurm runs a job as its submitter). The function (bench/trivial.py, pickled by value as a
notebook's function is) returns x + 1, the wall clock when it ran, and when its process started.
Each round runs one trip of each, their order turning round, so that the machine's drift reaches
all alike; a first trip of each comes before the rounds, reported apart (a notebook's first call:
gpupool ships the project and builds its environment then). Reported: p50, p99, min, p25, p75 and
max of submit -> `result()` returned, and the p50 of submit -> the result recorded (what a
caller that looked for it without pause would wait), and each step's p50 (a column of the steps'
table):
- submit(): the call itself (pickling; gpupool's project check, upload and enqueue; submitit's
  sbatch);
- process: submit() returned -> the job's process started (queueing, scheduling; gpupool's claim
  and the job's directory: project, inputs, environment);
- first act: the process started -> the function ran, by its own clock (the interpreter's
  start, the call unpickled);
- recorded: the function ran -> its result recorded (gpupool: the job's end recorded, after its
  result was pickled and uploaded; submitit: its result pickle written, which a side thread of the
  bench looks for every 5 ms);
- result(): recorded -> `result()` returned (the caller learning of the end and reading the
  result: gpupool's wait and download; submitit looks at its folder once a second).
gpupool's job record adds `to_enqueued` and `to_started` (its claim) in the JSON.

submitit keeps no state here: Slurm's accounting is off (sacct answers "Slurm accounting storage
is disabled"), so submitit warns at each of its status checks and finds the end by its result
file alone; its warnings and sacct's (the rounds' stderr) go to bench/results/python_api.stderr.log.
Every trip is bounded (`LIMIT`).
`python -m bench.python_api [--rounds N] [--quick] [--slurm-no-batch-delay]`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from bench.common import RESULTS, local_pool, machine, percentile, ready, save, summary_ms
from bench.trivial import trivial
from tests.support import slurm

if TYPE_CHECKING:
    import gpupool

LIMIT = 60.0  # seconds one round trip may take before the bench gives up
POLL = 0.005  # how often the bench looks for submitit's result file (the "recorded" moment)
NO_BATCH_DELAY = "SchedulerParameters=batch_sched_delay=0\n"


@dataclass
class Trip:
    """One round trip's moments, wall clock (time.time()) seconds; `pool_times`: gpupool's job
    record's own (enqueued_at, started_at: its claim)."""

    submitted: float  # just before submit()
    submit_returned: float
    process_started: float  # the process that ran the function (its clock tick)
    ran: float  # the function's own clock
    recorded: float  # the result recorded where the caller reads it
    returned: float  # result() returned
    pool_times: dict[str, float] = field(default_factory=dict)

    def intervals(self) -> dict[str, float]:
        return {
            "total": self.returned - self.submitted,
            "submit": self.submit_returned - self.submitted,
            "to_process": self.process_started - self.submit_returned,  # < 0: it started first
            "to_first_act": self.ran - self.process_started,
            "to_recorded": self.recorded - self.ran,
            "to_returned": self.returned - self.recorded,
            "until_recorded": self.recorded - self.submitted,  # what a caller that never slept would wait
            **{f"to_{k}": v - self.submitted for k, v in self.pool_times.items()},
        }


@contextlib.contextmanager
def bounded(seconds: float, what: str) -> Iterator[None]:
    """Raise TimeoutError in the main thread if the block takes longer than `seconds` (a blocking
    call with no timeout of its own, as submitit's `result()`, is interrupted by SIGALRM)."""

    def expired(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"{what} took more than {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class FileWatch:
    """A side thread that notes when a file first exists, looking every `POLL` seconds."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.path.exists():
                self.seen = time.time()
                return
            self._stop.wait(POLL)

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join()
        return self.seen


# --- gpupool ------------------------------------------------------------------------------------


def gpupool_trip(pool: gpupool.Pool, x: int) -> Trip:
    submitted = time.time()
    job = pool.submit(trivial, x)
    submit_returned = time.time()
    value, ran, process_started = job.result(timeout=LIMIT)
    returned = time.time()
    assert value == x + 1, value
    record = job.record()  # after the trip: the pool's own times of the job
    times = {k: float(record[f"{k}_at"]) for k in ("enqueued", "started")}
    return Trip(submitted, submit_returned, process_started, ran, float(record["ended_at"]), returned, times)


# --- submitit on Slurm --------------------------------------------------------------------------


def submitit_missing() -> str | None:
    """Why submitit on Slurm cannot run here, or None."""
    try:
        import submitit  # noqa: F401
    except ImportError:
        return "submitit is not installed (pip install submitit)"
    return slurm.missing()


@contextlib.contextmanager
def quiet_submitit(log: Path) -> Iterator[None]:
    """submitit's warnings (a failed sacct at each status check) and sacct's own complaint, which
    it writes to the stderr it inherits, go to `log` instead of the bench's output."""
    handler = logging.FileHandler(log)
    logger = logging.getLogger("submitit")
    saved = logger.handlers[:], logger.propagate
    logger.handlers[:] = [handler]
    logger.propagate = False
    sys.stderr.flush()
    stderr = os.dup(2)
    with open(log, "ab") as sink:
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(stderr, 2)
        os.close(stderr)
        logger.handlers[:], logger.propagate = saved
        handler.close()


def submitit_trip(executor: Any, x: int) -> Trip:  # a submitit.SlurmExecutor (bench extra)
    submitted = time.time()
    job = executor.submit(trivial, x)
    submit_returned = time.time()
    watch = FileWatch(job.paths.result_pickle)
    try:
        with bounded(LIMIT, f"submitit job {job.job_id}"):
            value, ran, process_started = job.result()
    finally:
        written = watch.stop()
    returned = time.time()
    assert value == x + 1, value
    return Trip(
        submitted, submit_returned, process_started, ran, min(written or returned, returned), returned
    )


# --- the run ------------------------------------------------------------------------------------


def measure(rounds: int, *, quick: bool = False, no_batch_delay: bool = False) -> dict[str, Any]:
    """`quick`: no trip apart, and no job in the project (whose first builds its environment,
    with packages from the index)."""
    import cloudpickle

    import gpupool

    # As a notebook's function goes: by value, so that a job needs nothing of the bench to load it.
    cloudpickle.register_pickle_by_value(sys.modules[trivial.__module__])
    why_not = submitit_missing()
    systems: dict[str, Callable[[int], Trip]] = {}
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-api-") as tmp_name:
        tmp = Path(tmp_name)
        tmp.chmod(0o711)  # poold checks that a job's uid could pass through it to data/worker
        with contextlib.ExitStack() as stack:
            proc = stack.enter_context(local_pool(tmp))
            if why_not is None:  # Slurm starts while poold does
                import submitit

                cluster = slurm.SlurmCluster(NO_BATCH_DELAY if no_batch_delay else "")
                cluster.start()
                stack.callback(cluster.stop)
                os.environ["SLURM_CONF"] = str(cluster.conf)  # for sbatch, scancel and sacct
                executor = submitit.SlurmExecutor(folder=tmp / "submitit")
                executor.update_parameters(time=5)
                RESULTS.mkdir(exist_ok=True)
                stack.enter_context(quiet_submitit(RESULTS / "python_api.stderr.log"))
                systems["submitit"] = lambda x: submitit_trip(executor, x)
            ready(proc, tmp)
            if not quick:
                pool = stack.enter_context(gpupool.connect())
                systems["gpupool"] = lambda x: gpupool_trip(pool, x)
            bare = stack.enter_context(gpupool.connect(project=False))
            systems["gpupool, no project"] = lambda x: gpupool_trip(bare, x)
            first = {} if quick else {name: trip(-1) for name, trip in systems.items()}
            trips: dict[str, list[Trip]] = {name: [] for name in systems}
            names = list(systems)
            for i in range(rounds):  # one of each, the order turning round
                for name in names[i % len(names) :] + names[: i % len(names)]:
                    trips[name].append(systems[name](i))
    return {
        "machine": machine(),
        "rounds": rounds,
        "slurm": why_not or {"batch_sched_delay": "0" if no_batch_delay else "default (3 s)"},
        "round_trip_ms": {name: spread([t.intervals()["total"] for t in ts]) for name, ts in trips.items()},
        "step_p50_ms": {name: step_p50s(ts) for name, ts in trips.items()},
        "first_trip_ms": {name: step_p50s([t]) for name, t in first.items()},
        "trips_ms": {
            name: [{k: v * 1000 for k, v in t.intervals().items()} for t in ts] for name, ts in trips.items()
        },
    }


def spread(seconds: list[float]) -> dict[str, float]:
    """p50, p90, p99, max (bench.common.summary_ms), and min, p25 and p75, in ms."""
    ms = [s * 1000 for s in seconds]
    return {**summary_ms(seconds), "min": min(ms), "p25": percentile(ms, 25), "p75": percentile(ms, 75)}


def step_p50s(trips: list[Trip]) -> dict[str, float]:
    """Each interval's p50 over `trips` (nearest rank, as the round trip's p50), in ms."""
    return {k: percentile([t.intervals()[k] for t in trips], 50) * 1000 for k in trips[0].intervals()}


STEPS = {  # the columns of "where the time goes": the docstring says what each holds
    "submit": "submit()",
    "to_process": "process",
    "to_first_act": "first act",
    "to_recorded": "recorded",
    "to_returned": "result()",
    "total": "total",
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=30, help="round trips of each")
    p.add_argument("--quick", action="store_true", help="one round trip of each, no first apart, no project")
    p.add_argument("--slurm-no-batch-delay", action="store_true", help="Slurm's batch_sched_delay=0")
    args = p.parse_args(argv)
    result = measure(
        1 if args.quick else args.rounds, quick=args.quick, no_batch_delay=args.slurm_no_batch_delay
    )
    save("python_api", result)
    console = Console(width=110)  # the steps' table, whole
    if isinstance(result["slurm"], str):
        console.print(f"submitit on Slurm left out: {result['slurm']}")
    t = Table(title=f"submit -> result(), a trivial function, {result['rounds']} round trips (ms)")
    t.add_column("", no_wrap=True)
    for col in ("p50", "p99", "min", "p25", "p75", "max", "p50 to recorded"):
        t.add_column(col, justify="right")
    for name, s in result["round_trip_ms"].items():
        recorded = result["step_p50_ms"][name]["until_recorded"]
        t.add_row(
            name, *(f"{s[k]:.1f}" for k in ("p50", "p99", "min", "p25", "p75", "max")), f"{recorded:.1f}"
        )
    console.print(t)
    t = Table(title="where the time goes: each step's p50, ms (the submit() call, then to the next)")
    t.add_column("", no_wrap=True)
    for col in STEPS.values():
        t.add_column(col, justify="right")
    for label, table in (("", result["step_p50_ms"]), (", first", result["first_trip_ms"])):
        for name, m in table.items():
            t.add_row(f"{name}{label}", *(f"{m[k]:.1f}" for k in STEPS))
    console.print(t)
    p50 = {name: s["p50"] for name, s in result["round_trip_ms"].items()}
    said = [f"{name} {ms:.1f} ms" for name, ms in p50.items()]
    if "submitit" in p50:
        said += [
            f"submitit / {name} {p50['submitit'] / p50[name]:.1f}x" for name in p50 if name != "submitit"
        ]
    console.print("round trip p50: " + "; ".join(said))


if __name__ == "__main__":
    main()
