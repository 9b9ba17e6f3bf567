"""Client-side submit rate through the real PoolClient over TCP: Enqueue one at a time (each awaited
before the next), and EnqueueBatch in batches of `--batch`. A real PoolServer with embedded Redis
and no local slots (nothing is claimed meanwhile) in this process; the client in a process of its
own (`python -m bench.enqueue --client ADDRESS`), as a user's laptop is, and as the peers' clients
are processes apart from their Redis."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import orjson
import uvloop
from rich.console import Console
from rich.table import Table

from bench.common import bench_server, machine, save
from daemon import tokens
from daemon.client.pool_client import PoolClient
from daemon.job import JobSpec
from protocol import Enqueue, EnqueueBatch, Enqueued, EnqueuedBatch


async def client_rates(address: str, jobs: int, batch: int) -> dict[str, float]:
    spec = JobSpec(argv=("true",), queue="bench").to_dict()
    del spec["user"]
    async with PoolClient(address, tokens.local_user(), tokens.client_token()) as c:
        for _ in range(100):  # warm up
            await c.call(Enqueue(spec, None), Enqueued)
        t0 = time.perf_counter()
        for _ in range(jobs):
            await c.call(Enqueue(spec, None), Enqueued)
        one = jobs / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for start in range(0, jobs * 5, batch):
            reply = await c.call(EnqueueBatch([spec] * min(batch, jobs * 5 - start)), EnqueuedBatch)
            assert reply.job_ids
        batched = jobs * 5 / (time.perf_counter() - t0)
    return {"one_at_a_time_per_s": one, "batched_per_s": batched}


async def measure(jobs: int, batch: int) -> dict[str, Any]:
    async with bench_server() as server:
        assert server.listener is not None
        assert server.queue is not None
        version = (await server.queue.redis.info("server"))["redis_version"]
        argv = [sys.executable, "-m", "bench.enqueue", "--client", server.listener.address]
        client = await asyncio.create_subprocess_exec(
            *argv, "--jobs", str(jobs), "--batch", str(batch), stdout=asyncio.subprocess.PIPE
        )
        out, _ = await client.communicate()
        if client.returncode != 0:
            raise RuntimeError(f"the bench client failed ({client.returncode})")
        rates = orjson.loads(out)
    return {"machine": machine(str(version)), "jobs": jobs, "batch": batch, **rates}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--jobs", type=int, default=2000, help="one-at-a-time jobs (5x that batched)")
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--quick", action="store_true", help="1000 jobs")
    p.add_argument("--client", metavar="ADDRESS", help="be the client process, submitting to ADDRESS")
    args = p.parse_args(argv)
    if args.client:
        print(orjson.dumps(uvloop.run(client_rates(args.client, args.jobs, args.batch))).decode())
        return
    result = uvloop.run(measure(1000 if args.quick else args.jobs, args.batch))
    t = Table(title="submit rate through PoolClient (TCP, auth'd session)")
    t.add_column("mode")
    t.add_column("jobs/s", justify="right")
    t.add_row("Enqueue, one at a time", f"{result['one_at_a_time_per_s']:,.0f}")
    t.add_row(f"EnqueueBatch of {args.batch}", f"{result['batched_per_s']:,.0f}")
    Console().print(t)
    print(f"wrote {save('enqueue', result)}")


if __name__ == "__main__":
    main()
