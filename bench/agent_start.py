"""What a job's start costs on an agent (issue 44 item 1), beside a worker that speaks to Redis.

One process runs a pool server (embedded Redis, listener on a free port) and, one after the other,
the two kinds of worker a pilot could be, each with 2 slots and no GPUs: a `Worker` on the server's
queue (Redis and the store's keys in hand, as before agents), and an `Agent` holding only the local
user's token, whose worker the server runs (worker/hosted.py) and whose orders and calls cross the
wire protocol over loopback. Jobs are submitted one at a time through the server's queue; each
prints the wall clock as its first act (`date +%s%N`). Measured: submit -> that line, and submit
-> its end recorded, medians of `--runs`, and their ratio agent / worker. What the agent adds is
the orders' and the calls' round trips through the server, the price of holding no credential.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvloop
from rich.console import Console
from rich.table import Table

from bench.common import bench_env, machine, median, save
from daemon import config, tokens
from daemon.client.pool_client import PoolClient
from daemon.job import JobSpec, JobState
from daemon.queue.job_queue import JobQueue
from daemon.server.service import PoolServer
from daemon.worker.agent import Agent
from daemon.worker.dispatcher import Worker
from daemon.worker.hosted import hosted_worker

ENDED = {JobState.SUCCEEDED, JobState.FAILED}
LIMIT = 30.0  # seconds one job may take to print and end before the bench gives up


async def one_start(queue: JobQueue) -> tuple[float, float]:
    """Seconds from submit to the job's first line, and to its end recorded."""
    submitted = time.time_ns()
    job_id, _ = await queue.enqueue(JobSpec(argv=("date", "+%s%N"), user=tokens.local_user()))
    after, seen = "0-0", b""
    async with asyncio.timeout(LIMIT):  # a bench stops by itself
        while not seen.strip():
            chunks = await queue.read_log(job_id, after, block=1.0)
            if chunks:
                after, seen = chunks[-1][0], seen + b"".join(data for _, data in chunks)
            elif (info := await queue.get(job_id)).state in ENDED:
                raise RuntimeError(f"job {job_id} ended without its line: {info.state} {info.detail}")
    first = (int(seen.split()[0]) - submitted) / 1e9
    async with asyncio.timeout(LIMIT):
        while (info := await queue.get(job_id)).state not in ENDED:  # noqa: ASYNC110 - a bench polls
            await asyncio.sleep(0.002)
    assert info.ended_at is not None
    return first, info.ended_at - submitted / 1e9


@asynccontextmanager
async def a_worker(server: PoolServer, tmp: Path) -> AsyncIterator[None]:
    assert server.queue is not None
    worker = Worker(server.queue, data_dir=tmp / "worker", slots=2, gpus=[], drain_timeout=1.0)
    await worker.start()
    try:
        yield
    finally:
        await worker.stop()


@asynccontextmanager
async def an_agent(server: PoolServer, tmp: Path) -> AsyncIterator[None]:
    assert server.listener is not None
    client = PoolClient(server.listener.address, tokens.local_user(), tokens.client_token())
    agent = Agent(client, data_dir=tmp / "agent", slots=2, gpus=[], drain_timeout=1.0)
    await agent.start()
    try:
        yield
    finally:
        await agent.stop()


async def measure(runs: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-agent-") as tmp:
        env = bench_env(tmp, GPUPOOL_WORKER_LOCAL_PROCESSORS="0")
        server = PoolServer(config.load(None, env=env), agent_workers=hosted_worker)
        await server.start()
        try:
            assert server.queue is not None
            for name, kind in (("worker", a_worker), ("agent", an_agent)):
                async with kind(server, Path(tmp)):
                    await one_start(server.queue)  # the first: caches, connections
                    times = [await one_start(server.queue) for _ in range(runs)]
                results[name] = {
                    "first_line_ms": median([t[0] for t in times]) * 1000,
                    "ended_ms": median([t[1] for t in times]) * 1000,
                    "runs": runs,
                }
        finally:
            await server.stop()
    results["ratio_first_line"] = results["agent"]["first_line_ms"] / results["worker"]["first_line_ms"]
    results["ratio_ended"] = results["agent"]["ended_ms"] / results["worker"]["ended_ms"]
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=15, help="jobs per kind of worker (medians)")
    p.add_argument("--quick", action="store_true", help="5 jobs per kind")
    args = p.parse_args(argv)
    result = uvloop.run(measure(5 if args.quick else args.runs))
    save("agent_start", {"machine": machine(), **result})
    table = Table(title="a job's start: agent vs worker on Redis (medians, ms)")
    for column in ("", "submit -> first line", "submit -> end recorded"):
        table.add_column(column)
    for name in ("worker", "agent"):
        table.add_row(name, f"{result[name]['first_line_ms']:.1f}", f"{result[name]['ended_ms']:.1f}")
    table.add_row("agent / worker", f"{result['ratio_first_line']:.2f}x", f"{result['ratio_ended']:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
