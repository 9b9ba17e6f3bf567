"""Latency on an idle pool: enqueue -> start and enqueue -> completion recorded, p50/p90/p99/max.

One process runs an embedded Redis, a real PoolServer (listener and metrics on port 0) and the
executor, as `poold` runs a single machine's pool with its local slots; jobs are submitted one at
a time, `--gap` apart, through the real PoolClient (Enqueue over the pool's Unix socket, as poolctl
on the pool's machine sends it) by a client in a process of its own (`python -m bench.latency
--client ADDRESS`), as poolctl is. Two executors, one after the
other, on the same pool:

- `noop`: the queue alone. A real `Worker` (2 slots) with the bench's no-op executor
  (bench/noop.py: no process): "start" is the moment the attempt began (its lease claimed and
  handed to a slot), "completed" the moment `complete` returned.
- `command` (`date +%s%N`): a real `Worker` (2 slots, no GPUs) in this process, claiming through
  the server's JobQueue as poold's local slots do. "claimed" is when its claim returned
  (`claim_many`, or the standing claim an enqueue sent: claims.Standing), "process started"
  when `spawn` returned in the runner (the process exists; on x86-64 its exec may still be under
  way), "completed" when its `complete` returned.
  The timestamps come from wrappers the bench puts around the queue's methods and the runner's
  spawn call (instrumentation only; the daemon code path is unchanged). "first act" is the time
  the job itself printed, as its first act.
- `task-spooler`, where `tsp` is installed (bench/task_spooler.py): `tsp date +%s%N` on an idle
  private tsp server, the same `--command-gap` apart, run by a process of its own at the same
  time as the `command` jobs, each of its submissions half a gap after one of theirs (so both see
  the machine as it is at the time: on a shared VM that changes from one minute to the next);
  "first act" as above, from just before its client was started. The one figure measured the
  same way for both: submit -> first act.

All times are CLOCK_MONOTONIC in ns (`time.monotonic_ns()`, one clock for every process of the
machine), so sub-millisecond (the job record's `started_at` is Redis time in whole milliseconds:
too coarse for a 2 ms target), except first act: the real-time clock (ns), which the job reads too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import uvloop
from rich.console import Console
from rich.table import Table

from bench import task_spooler
from bench.common import bench_server, machine, save, summary_ms
from bench.noop import noop_worker, record_completions
from daemon import tokens
from daemon.client.pool_client import PoolClient
from daemon.job import JobSpec, JobState, Lease, Outcome
from daemon.queue.fast_path import Standing
from daemon.queue.job_queue import JobQueue
from daemon.server.service import PoolServer
from daemon.worker import spawn
from daemon.worker.cgroups import SlotCgroup
from daemon.worker.dispatcher import Worker
from daemon.worker.identity import SlotIdentity
from protocol import Enqueue, Enqueued

QUEUE = "default"
INTERLEAVE_START = 2.0  # s for both submitters to be up (a process each) before their first job


async def client(
    address: str, jobs: int, gap: float, spec: dict[str, Any], start: float | None
) -> dict[str, tuple[int, int]]:
    """The client process: submit `jobs` jobs `gap` apart, from `start` (time.monotonic(); None:
    at once); when each was sent, by job id, on the monotonic clock and on the real-time one (the
    clock a job can read too), in ns."""
    submitted: dict[str, tuple[int, int]] = {}
    async with PoolClient(address, tokens.local_user(), tokens.client_token()) as c:
        first = time.monotonic() if start is None else start
        for i in range(jobs):
            await asyncio.sleep(max(0.0, first + i * gap - time.monotonic()))
            t0, ns = time.monotonic_ns(), time.time_ns()
            reply = await c.call(Enqueue(spec, None), Enqueued)
            submitted[reply.job_id] = (t0, ns)
    return submitted


async def submit(
    server: PoolServer,
    jobs: int,
    gap: float,
    spec: dict[str, Any],
    *,
    wall: dict[str, int] | None = None,
    start: float | None = None,
) -> dict[str, float]:
    """Submit through a client process of its own (`client`): when each job was sent (monotonic
    seconds; and, into `wall`, the real-time clock in ns)."""
    assert server.listener is not None
    argv = [sys.executable, "-m", "bench.latency", "--client", server.listener.local_address]
    argv += ["--jobs", str(jobs), "--gap", str(gap), "--spec", orjson.dumps(spec).decode()]
    if start is not None:
        argv += ["--start", repr(start)]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the bench client failed ({proc.returncode})")
    sent: dict[str, list[int]] = orjson.loads(out)
    if wall is not None:
        wall.update({job_id: ns for job_id, (_, ns) in sent.items()})
    return {job_id: t0 / 1e9 for job_id, (t0, _) in sent.items()}


def now() -> float:
    """Monotonic seconds, on the clock the client process reads too."""
    return time.monotonic_ns() / 1e9


async def wait_all(done: dict[str, float], ids: dict[str, float], limit: float) -> None:
    deadline = time.monotonic() + limit
    while any(i not in done for i in ids) and time.monotonic() < deadline:  # noqa: ASYNC110 - bounded
        await asyncio.sleep(0.02)


def deltas(submitted: dict[str, float], at: dict[str, float]) -> list[float]:
    return [at[j] - t0 for j, t0 in submitted.items() if j in at]


async def run_noop(server: PoolServer, jobs: int, gap: float, tmp: Path) -> dict[str, Any]:
    assert server.queue is not None
    queue = JobQueue(server.queue.redis)
    started: dict[str, float] = {}
    done: dict[str, float] = {}
    record_completions(queue, done)
    worker = noop_worker(queue, tmp / "noop-worker", QUEUE, 2, started)
    await worker.start()
    try:
        await asyncio.sleep(0.2)  # the worker is blocked on the stream: the pool is idle
        spec = JobSpec(argv=("true",), queue=QUEUE).to_dict()
        del spec["user"]
        submitted = await submit(server, jobs, gap, spec)
        await wait_all(done, submitted, 30)
    finally:
        await worker.stop(drain_timeout=5)
    return {
        "enqueue_to_start_ms": summary_ms(deltas(submitted, started)),
        "enqueue_to_completed_ms": summary_ms(deltas(submitted, done)),
    }


async def run_command(
    server: PoolServer, jobs: int, gap: float, tmp: Path, start: float | None = None
) -> dict[str, Any]:
    assert server.queue is not None
    queue = server.queue  # the slots claim through the server's queue, as poold's local slots do
    claimed: dict[str, float] = {}
    spawned: dict[str, float] = {}
    done: dict[str, float] = {}
    claim_many, standing_claimed = queue.claim_many, queue.standing_claimed

    async def claim_timed(*args: Any, **kwargs: Any) -> list[Lease]:
        leases = await claim_many(*args, **kwargs)
        for lease in leases:
            claimed[lease.job_id] = now()
        return leases

    async def standing_timed(standing: Standing) -> list[Lease]:
        leases = await standing_claimed(standing)
        for lease in leases:
            claimed[lease.job_id] = now()
        return leases

    queue.claim_many = claim_timed  # type: ignore[method-assign]
    queue.standing_claimed = standing_timed  # type: ignore[method-assign]
    record_completions(queue, done)
    first_act: dict[str, int] = {}  # job id -> the time its `date` printed (ns)
    complete = queue.complete

    async def complete_read(lease: Lease, outcome: Outcome, **kwargs: Any) -> JobState:
        with contextlib.suppress(LookupError, ValueError):
            first_act[lease.job_id] = int(outcome.result["tail"][0])
        return await complete(lease, outcome, **kwargs)

    queue.complete = complete_read  # type: ignore[method-assign]
    real_spawn = spawn.Spawner.spawn

    def timed_spawn(
        self: spawn.Spawner,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[str, str],
        identity: SlotIdentity | None = None,
        cgroup: SlotCgroup | None = None,
        gpus: Collection[int] | None = None,
        terminal: int | None = None,
        joins: tuple[int, ...] = (),
    ) -> spawn.Child:
        child = real_spawn(
            self,
            argv,
            cwd=cwd,
            env=env,
            identity=identity,
            cgroup=cgroup,
            gpus=gpus,
            terminal=terminal,
            joins=joins,
        )
        if "GPUPOOL_JOB_ID" in env:
            spawned[env["GPUPOOL_JOB_ID"]] = now()
        return child

    worker = Worker(queue, data_dir=tmp / "worker", slots=2, queues=[QUEUE], gpus=[])
    spawn.Spawner.spawn = timed_spawn  # type: ignore[method-assign]
    try:
        await worker.start()
        await asyncio.sleep(0.2)
        spec = JobSpec(argv=("date", "+%s%N"), queue=QUEUE).to_dict()
        del spec["user"]
        wall: dict[str, int] = {}
        submitted = await submit(server, jobs, gap, spec, wall=wall, start=start)
        await wait_all(done, submitted, 60)
    finally:
        spawn.Spawner.spawn = real_spawn  # type: ignore[method-assign]
        await worker.stop(drain_timeout=5)
        for name in ("claim_many", "standing_claimed", "complete"):
            vars(queue).pop(name, None)  # the server's queue as it was
    spawn_cost = [spawned[j] - claimed[j] for j in submitted if j in spawned and j in claimed]
    return {
        "enqueue_to_claimed_ms": summary_ms(deltas(submitted, claimed)),
        "enqueue_to_process_started_ms": summary_ms(deltas(submitted, spawned)),
        "enqueue_to_completed_ms": summary_ms(deltas(submitted, done)),
        "claimed_to_process_started_ms": summary_ms(spawn_cost),
        "enqueue_to_first_act_ms": summary_ms(
            [(first_act[j] - t) / 1e9 for j, t in wall.items() if j in first_act]
        ),
    }


async def measure(jobs: int, gap: float, command_gap: float) -> dict[str, Any]:
    async with bench_server() as server:
        assert server.listener is not None
        assert server.queue is not None
        version = (await server.queue.redis.info("server"))["redis_version"]
        data = server.config.data_path()
        noop = await run_noop(server, jobs, gap, data)
        # The pool's command jobs and task-spooler's interleaved, each `command_gap` apart and
        # half of it after the other's: the machine is as busy (or its neighbours as loud) for
        # both, which one after the other, on a shared VM, it was not.
        start = time.monotonic() + INTERLEAVE_START
        peer = None
        if task_spooler.TSP is not None:
            argv = [sys.executable, "-m", "bench.task_spooler", str(jobs), str(command_gap)]
            argv.append(repr(start + command_gap / 2))
            peer = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
        try:
            command = await run_command(server, jobs, command_gap, data, start)
        finally:
            out, _ = await peer.communicate() if peer is not None else (b"", None)
    peers: dict[str, Any] = {}
    if peer is not None:
        if peer.returncode != 0:
            raise RuntimeError(f"the task-spooler run failed ({peer.returncode})")
        peers["task-spooler"] = {"submit_to_first_act_ms": summary_ms(orjson.loads(out))}
    return {
        "machine": machine(str(version)),
        "jobs": jobs,
        "gap_s": gap,
        "command_gap_s": command_gap,
        "noop": noop,
        "command": command,
        **peers,
    }


def table(result: dict[str, Any]) -> Table:
    t = Table(
        title=f"idle-pool latency (ms), {result['jobs']} jobs {result['gap_s'] * 1000:.0f} ms apart "
        f"(command jobs {result['command_gap_s'] * 1000:.0f} ms apart)"
    )
    for col in ("executor", "interval", "p50", "p90", "p99", "max", "n"):
        t.add_column(col, justify="left" if col in ("executor", "interval") else "right")
    for executor in ("noop", "command", "task-spooler"):
        for interval, s in result.get(executor, {}).items():
            t.add_row(
                executor,
                interval.removesuffix("_ms").replace("_", " "),
                *(f"{s[k]:.2f}" for k in ("p50", "p90", "p99", "max")),
                str(s["n"]),
            )
    return t


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=300)
    p.add_argument("--gap", type=float, default=0.010, help="seconds between submissions")
    p.add_argument(
        "--command-gap",
        type=float,
        default=0.050,
        help="seconds between command-job submissions: at 10 ms one worker falls behind (~60 jobs/s), "
        "and the pool is no longer idle",
    )
    p.add_argument("--quick", action="store_true", help="100 jobs")
    p.add_argument("--client", metavar="ADDRESS", help=argparse.SUPPRESS)  # the client process
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--start", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        sent = uvloop.run(client(args.client, args.jobs, args.gap, orjson.loads(args.spec), args.start))
        print(orjson.dumps(sent).decode())
        return
    result = uvloop.run(measure(100 if args.quick else args.jobs, args.gap, args.command_gap))
    Console().print(table(result))
    print(f"wrote {save('latency', result)}")


if __name__ == "__main__":
    main()
