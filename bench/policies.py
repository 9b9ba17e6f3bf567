"""What the scheduling policies cost a claim: the no-op drain with plain FIFO, with priorities, with
caps per user, with fair share and with backfill, side by side in one run (issue 17: within 20 % of
FIFO).

The queue alone against a fresh embedded redis-server, as a worker of `--slots` slots drives it:
claim up to the free slots in one call, complete every job claimed (the completes pipelined
together), again, until `--jobs` jobs are done. Modes, in rounds (each round runs every mode once,
in turn, so that the machine's drift falls on all of them):

- fifo: no priorities, no caps;
- priorities: every job enqueued with a priority from 0 to 10;
- caps: jobs of 10 users in turn, `user_max_running_jobs` = the slots / 2 (so caps bind: every claim
  counts what each user runs from the leases, and holds jobs aside);
- fairshare: jobs of 10 users in turn, in a fair-share queue: every claim reads new entries into
  the users' lines and ranks the users by recent use (charged as each attempt ends);
- backfill: every 4th job asks for all 8 of the worker's GPUs and the others for one, with time
  limits; the worker passes when its running jobs end, so each big job heads the queue, reserves
  the worker and lets the small ones that end in time start beside what runs. Its jobs/s is of
  another workload (GPU-bound, every 4th job waiting for all 8 GPUs), so no ratio to FIFO is
  given: compare its claim latency.

Reported: jobs/s and the claim call's p50/p99 (ms), medians of the rounds, and each mode's jobs/s
as a ratio to FIFO's in the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop
from rich.console import Console
from rich.table import Table

from bench.common import machine, save, summary_ms
from daemon.job import JobSpec, JobState, Outcome
from daemon.queue.claims import Capacity
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue

DONE = Outcome(JobState.SUCCEEDED, exit_code=0)
MODES = ("fifo", "priorities", "caps", "fairshare", "backfill")
GPUS = 8
USERS = 10


def specs(mode: str, jobs: int, queue: str) -> list[JobSpec]:
    rng = random.Random(7)
    return [
        JobSpec(
            argv=("true",),
            queue=queue,
            priority=rng.randint(0, 10) if mode == "priorities" else 0,
            user=f"user{i % USERS}",
            gpus=(GPUS if i % 4 == 0 else 1) if mode == "backfill" else 0,
            timeout=(60.0 if i % 4 == 0 else 30.0) if mode == "backfill" else None,
        )
        for i in range(jobs)
    ]


async def drain(queue: JobQueue, name: str, jobs: int, slots: int, *, gpus: bool) -> dict[str, Any]:
    """Claim and complete until `jobs` are done. With `gpus`, the worker has GPUS GPUs and keeps
    the jobs of one claim running while it claims again (so heads wait and reserve, and small jobs
    backfill beside them), completing them once a claim finds nothing more to start."""
    claims: list[float] = []
    done = 0
    running: list[Any] = []
    started = time.perf_counter()
    while done < jobs:
        free = GPUS - sum(lease.spec.gpus for lease in running)
        ends = [(30.0, lease.spec.gpus) for lease in running]
        room = Capacity(gpus_free=free, gpus_total=GPUS, ends=ends) if gpus else None
        t = time.perf_counter()
        leases = await queue.claim_many("bench-worker", [name], slots - len(running), room)
        claims.append(time.perf_counter() - t)
        running += leases
        if not leases and not running:
            raise AssertionError(f"{name}: {jobs - done} jobs left but none claimable")
        if not leases or len(running) >= slots or not gpus:
            await asyncio.gather(*(queue.complete(lease, DONE) for lease in running))
            done += len(running)
            running = []
    return {"jobs_per_s": jobs / (time.perf_counter() - started), "claim_ms": summary_ms(claims)}


async def measure(jobs: int, slots: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis")
        server.start()
        client = server.client()
        try:
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
            for r in range(rounds):
                for mode in MODES:
                    caps = (slots // 2, 0) if mode == "caps" else (0, 0)
                    name = f"{mode}-{r}"
                    fair = [name] if mode == "fairshare" else []
                    queue = JobQueue(client, lease_seconds=60, user_caps=caps, fairshare=fair)
                    await queue.enqueue_many(specs(mode, jobs, name))
                    runs[mode].append(await drain(queue, name, jobs, slots, gpus=mode == "backfill"))
            out: dict[str, Any] = {}
            for mode in MODES:
                rates = [run["jobs_per_s"] for run in runs[mode]]
                ratios = [
                    a["jobs_per_s"] / b["jobs_per_s"] for a, b in zip(runs[mode], runs["fifo"], strict=True)
                ]
                out[mode] = {
                    "jobs_per_s": statistics.median(rates),
                    "ratio_to_fifo": statistics.median(ratios),
                    "claim_p50_ms": statistics.median(run["claim_ms"]["p50"] for run in runs[mode]),
                    "claim_p99_ms": statistics.median(run["claim_ms"]["p99"] for run in runs[mode]),
                    "runs": runs[mode],
                }
        finally:
            await client.aclose()
            server.stop()
    return {"machine": machine(), "jobs": jobs, "slots": slots, "rounds": rounds, "modes": out}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=4000)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="1 000 jobs, 3 rounds")
    args = p.parse_args(argv)
    jobs, rounds = (1000, 3) if args.quick else (args.jobs, args.rounds)
    result = uvloop.run(measure(jobs, args.slots, rounds))
    table = Table(title=f"No-op drain, {jobs} jobs, {args.slots} slots: medians of {rounds} rounds")
    for column in ("mode", "jobs/s", "ratio to FIFO", "claim p50 ms", "claim p99 ms"):
        table.add_column(column, justify="right")
    for mode, r in result["modes"].items():
        table.add_row(
            mode,
            f"{r['jobs_per_s']:.0f}",
            "-" if mode == "backfill" else f"{r['ratio_to_fifo']:.2f}",  # another workload: see above
            f"{r['claim_p50_ms']:.2f}",
            f"{r['claim_p99_ms']:.2f}",
        )
    Console().print(table)
    print(f"wrote {save('policies', result)}")


if __name__ == "__main__":
    main()
