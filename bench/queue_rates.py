"""Queue operation rates in one process against a fresh embedded redis-server.

Measures jobs/s for: enqueue one at a time, enqueue in batches (enqueue_many), and claim+complete
one at a time, each repeated and reported as the median of the runs. This is the queue alone (no
wire protocol, no processes): the ceiling the rest of the pool builds on.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import uvloop
from rich.console import Console
from rich.table import Table

from bench.common import machine, median, save
from daemon.job import JobSpec, JobState, Outcome
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue

DONE = Outcome(JobState.SUCCEEDED, exit_code=0)


async def one_run(queue: JobQueue, jobs: int, batch: int) -> dict[str, float]:
    spec = JobSpec(argv=("true",), queue="bench")
    t0 = time.perf_counter()
    for _ in range(jobs):
        await queue.enqueue(spec)
    t1 = time.perf_counter()
    for _ in range(0, jobs, batch):
        await queue.enqueue_many([spec] * batch)
    t2 = time.perf_counter()
    done = 0
    while (lease := await queue.claim("bench-worker", ["bench"])) is not None:
        await queue.complete(lease, DONE)
        done += 1
    t3 = time.perf_counter()
    assert done == 2 * jobs, done
    return {
        "enqueue_per_s": jobs / (t1 - t0),
        "enqueue_batched_per_s": jobs / (t2 - t1),
        "claim_complete_per_s": done / (t3 - t2),
    }


async def measure(jobs: int, batch: int, runs: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(Path(tmp))
        server.start()
        try:
            client = server.client()
            version = (await client.info("server"))["redis_version"]
            queue = JobQueue(client)
            samples = [await one_run(queue, jobs, batch) for _ in range(runs)]
            await client.aclose()
        finally:
            server.stop()
    medians = {k: median([s[k] for s in samples]) for k in samples[0]}
    return {
        "machine": machine(str(version)),
        "jobs": jobs,
        "batch": batch,
        "runs": runs,
        "samples": samples,
        "median": medians,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    result = uvloop.run(measure(args.jobs, args.batch, args.runs))
    table = Table(title=f"queue operations, one process, embedded Redis ({args.runs} runs, median)")
    table.add_column("operation")
    table.add_column("jobs/s", justify="right")
    for name, value in result["median"].items():  # type: ignore[attr-defined]
        table.add_row(name, f"{value:,.0f}")
    Console().print(table)
    print(f"wrote {save('queue_rates', result)}")


if __name__ == "__main__":
    main()
