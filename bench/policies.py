"""What the scheduling policies cost a claim: the no-op drain with plain FIFO, with priorities, and
with caps per user, side by side in one run (issue 17: within 20 % of FIFO).

The queue alone against a fresh embedded redis-server, as a worker of `--slots` slots drives it:
claim up to the free slots in one call, complete every job claimed (the completes pipelined
together), again, until `--jobs` jobs are done. Modes, in rounds (each round runs every mode once,
in turn, so that the machine's drift falls on all of them):

- fifo: no priorities, no caps;
- priorities: every job enqueued with a priority from 0 to 10;
- caps: jobs of 10 users in turn, `user_max_running_jobs` = the slots / 2 (so caps bind: every claim
  counts what each user runs from the leases, and holds jobs aside).

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
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue

DONE = Outcome(JobState.SUCCEEDED, exit_code=0)
MODES = ("fifo", "priorities", "caps")
USERS = 10


def specs(mode: str, jobs: int, queue: str) -> list[JobSpec]:
    rng = random.Random(7)
    return [
        JobSpec(
            argv=("true",),
            queue=queue,
            priority=rng.randint(0, 10) if mode == "priorities" else 0,
            user=f"user{i % USERS}",
        )
        for i in range(jobs)
    ]


async def drain(queue: JobQueue, name: str, jobs: int, slots: int) -> dict[str, Any]:
    claims: list[float] = []
    done = 0
    started = time.perf_counter()
    while done < jobs:
        t = time.perf_counter()
        leases = await queue.claim_many("bench-worker", [name], slots)
        claims.append(time.perf_counter() - t)
        if not leases:
            raise AssertionError(f"{name}: {jobs - done} jobs left but none claimable")
        await asyncio.gather(*(queue.complete(lease, DONE) for lease in leases))
        done += len(leases)
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
                    queue = JobQueue(client, lease_seconds=60, user_caps=caps)
                    name = f"{mode}-{r}"
                    await queue.enqueue_many(specs(mode, jobs, name))
                    runs[mode].append(await drain(queue, name, jobs, slots))
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
            f"{r['ratio_to_fifo']:.2f}",
            f"{r['claim_p50_ms']:.2f}",
            f"{r['claim_p99_ms']:.2f}",
        )
    Console().print(table)
    print(f"wrote {save('policies', result)}")


if __name__ == "__main__":
    main()
