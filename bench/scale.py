"""Scale: what one Redis (and the pool's Python clients) pay as the pool grows.

Simulated workers, in this one process, against a fresh embedded redis-server holding many queued
jobs: each worker has 2 slots, heartbeats every `--heartbeat` seconds with the real heartbeat batch
(registration + lease renewals in one round trip), claims with the real claim script when a slot is
free, "runs" each job for `--job-seconds`, and completes it. The reaper runs its real pass.

Reported per pool size: Redis commands/s (INFO stats), redis-server CPU share (psutil), the
reaper's pass time, Redis memory per queued job (INFO memory before and after filling the queue),
and claim latency at that depth. The client side is one Python process: at 1 000 workers it is the
limit, not Redis; the Redis CPU share shows how much headroom the server has.

Then what many queues cost the server: with 1 and 100 queues, the reaper's pass and the metrics'
depth reading (one pipelined round trip for all queues), side by side with the same calls made one
queue at a time in the same run, and the idle events reader's Redis commands per second.

`--cluster` (issue 16) runs instead one Redis against a three-shard Redis Cluster
(tests/support/cluster.py, on loopback) with the same simulated workers (1 000 by default), in one
run, the two modes alternated over `--rounds`. A queue's keys live in one slot (`{q:NAME}`), so the
workers serve six queues, two on each shard, each worker one of them, the same six on the one
Redis; the pool-wide keys (`{pool}`: registry, heartbeats) live on one of the shards besides its two
queues. Reported per shard: Redis commands/s and redis-server CPU share; per mode: claim latency,
jobs done/s and this process's CPU share (the simulated clients); and the `{pool}` shard's excess
over the mean of the other two, which is what the pool-wide keys cost (their queues' work is the
same). The workers start within one job's length of each other and the window opens after that (a
steady flow, not every slot's first claim at once); "others" is the rest of the machine's busy CPU
in the window, which says whether something else was running. Results: scale_cluster.json (1 000
workers) or scale_cluster_N.json.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis as redis_sync
import uvloop
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from rich.console import Console
from rich.table import Table

from bench.common import machine, save, summary_ms
from daemon.aio import cancel_and_wait
from daemon.job import JobSpec, JobState, Lease, Outcome
from daemon.queue import keys
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.queue.registry import Registration, add_heartbeat, new_worker_id
from daemon.queue.terminal_events import JobEvents
from tests.support.cluster import ClusterGroup, ClusterServer

DONE = Outcome(JobState.SUCCEEDED, exit_code=0)


async def fill(queue: JobQueue, jobs: int) -> None:
    spec = JobSpec(argv=("true",), queue="scale")
    for start in range(0, jobs, 1000):
        await queue.enqueue_many([spec] * min(1000, jobs - start))


async def simulated_worker(
    queue: JobQueue,
    stop: float,
    heartbeat: float,
    job_seconds: float,
    claims: list[float],
    *,
    name: str = "scale",
    start_within: float = 0.0,
    tally: collections.Counter[str] | None = None,
) -> int:
    """One worker serving queue `name`, from a random moment within `start_within` seconds (so
    that the jobs of many do not all end together); `tally` counts its heartbeats and jobs done."""
    if start_within:
        await asyncio.sleep(random.uniform(0, start_within))
    reg = Registration(id=new_worker_id("sim"), slots=2, queues=[name], healthy_period=30.0)
    running: dict[str, tuple[Lease, float]] = {}
    next_beat = time.monotonic() + random.uniform(0, heartbeat)  # spread the beats
    done = 0
    while (now := time.monotonic()) < stop:
        for job_id, (lease, until) in list(running.items()):
            if now >= until:
                await queue.complete(lease, DONE)
                del running[job_id]
                done += 1
                if tally is not None:
                    tally["jobs_done"] += 1
        while len(running) < reg.slots:
            t0 = time.perf_counter()
            got = await queue.claim(reg.id, [name])
            claims.append(time.perf_counter() - t0)
            if got is None:
                break
            running[got.job_id] = (got, time.monotonic() + job_seconds)
        if now >= next_beat:
            reg.running = len(running)
            batch = queue.batch(ack=False)  # as a worker's heartbeat makes it
            add_heartbeat(batch, queue.scripts, reg)
            answers = queue.add_renewals(batch, reg.id, [lease for lease, _ in running.values()])
            answers(await batch.execute())
            if tally is not None:
                tally["heartbeats"] += 1
            next_beat += heartbeat
        await asyncio.sleep(min(0.05, max(0.0, next_beat - time.monotonic())))
    return done


async def point(
    server: EmbeddedRedis, workers: int, *, jobs: int, seconds: float, heartbeat: float, job_seconds: float
) -> dict[str, Any]:
    pool = BlockingConnectionPool(
        host=server.host, port=server.port, password=server.password, max_connections=64
    )
    client = Redis(connection_pool=pool)
    queue = JobQueue(client, lease_seconds=30)
    await client.flushall()  # a fresh redis-server of the bench's own, never a shared one
    mem0 = int((await client.info("memory"))["used_memory"])
    await fill(queue, jobs)
    mem1 = int((await client.info("memory"))["used_memory"])
    redis_proc = psutil.Process(server.pid)
    cpu0, cmds0, t0 = (
        redis_proc.cpu_times(),
        int((await client.info("stats"))["total_commands_processed"]),
        time.monotonic(),
    )
    claims: list[float] = []
    stop = time.monotonic() + seconds
    done = await asyncio.gather(
        *(simulated_worker(queue, stop, heartbeat, job_seconds, claims) for _ in range(workers))
    )
    elapsed = time.monotonic() - t0
    cpu1, cmds1 = redis_proc.cpu_times(), int((await client.info("stats"))["total_commands_processed"])
    reaper = []
    for _ in range(5):
        r0 = time.perf_counter()
        await queue.reclaim(["scale"])
        reaper.append(time.perf_counter() - r0)
    await client.aclose()
    await pool.aclose()
    return {
        "workers": workers,
        "slots": workers * 2,
        "queued": jobs,
        "seconds": elapsed,
        "jobs_done": sum(done),
        "redis_commands_per_s": (cmds1 - cmds0) / elapsed,
        "redis_cpu_share": ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / elapsed,
        "memory_per_queued_job_bytes": (mem1 - mem0) / jobs,
        "claim_ms": summary_ms(claims),
        "reaper_pass_ms": summary_ms(reaper),
    }


async def _timed(call: Any, runs: int = 20) -> dict[str, float]:
    took = []
    for _ in range(runs):
        t0 = time.perf_counter()
        await call()
        took.append(time.perf_counter() - t0)
    return summary_ms(took)


async def queues_point(server: EmbeddedRedis, n: int, idle_seconds: float = 3.0) -> dict[str, Any]:
    client = server.client()
    await client.flushall()
    queue = JobQueue(client, lease_seconds=30)
    names = [f"q{i}" for i in range(n)]
    await queue.enqueue_many([JobSpec(argv=("true",), queue=q) for q in names])

    async def one_by_one_reclaim() -> None:
        for q in names:
            await queue.reclaim([q])

    async def one_by_one_depth() -> None:
        for q in names:
            await queue.depth(q)

    out: dict[str, Any] = {
        "queues": n,
        "reaper_pass_ms": await _timed(lambda: queue.reclaim(names)),
        "reaper_one_by_one_ms": await _timed(one_by_one_reclaim),
        "depths_ms": await _timed(lambda: queue.depths(names)),
        "depths_one_by_one_ms": await _timed(one_by_one_depth),
    }
    events = JobEvents(queue, 1.0)
    await events.prime()
    before = await client.info("commandstats")
    reader = asyncio.create_task(events.run())
    await asyncio.sleep(idle_seconds)
    await cancel_and_wait(reader)
    after = await client.info("commandstats")
    calls = sum(int(after[k]["calls"]) - int(before.get(k, {"calls": 0})["calls"]) for k in after)
    out["idle_events_reader_commands_per_s"] = (calls - 1) / idle_seconds  # less the INFO itself
    await client.aclose()
    return out


async def measure(
    sizes: list[int], jobs: int, seconds: float, heartbeat: float, job_seconds: float
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(Path(tmp))
        server.start()
        try:
            probe = server.client()
            version = str((await probe.info("server"))["redis_version"])
            await probe.aclose()
            points = [
                await point(
                    server, n, jobs=jobs, seconds=seconds, heartbeat=heartbeat, job_seconds=job_seconds
                )
                for n in sizes
            ]
            queues = [await queues_point(server, n) for n in (1, 100)]
        finally:
            server.stop()
    return {
        "machine": machine(version),
        "heartbeat_s": heartbeat,
        "job_seconds": job_seconds,
        "points": points,
        "queues": queues,
    }


# -- one Redis against a three-shard Cluster (issue 16) ------------------------------------------


@dataclass
class Shard:
    """One redis-server of a mode: its process (CPU, by psutil), a client of its own for INFO, and
    what it holds (queues, and `{pool}` for the pool-wide keys)."""

    label: str
    pid: int
    info: redis_sync.Redis
    holds: list[str] = field(default_factory=list)

    def sample(self) -> tuple[float, int, int]:
        """CPU seconds so far, commands processed so far (not counting these two INFOs), clients
        connected now (this one among them)."""
        cpu = psutil.Process(self.pid).cpu_times()
        stats: dict[str, Any] = self.info.info("stats")
        clients: dict[str, Any] = self.info.info("clients")
        commands, connected = int(stats["total_commands_processed"]), int(clients["connected_clients"])
        return cpu.user + cpu.system, commands, connected


def spread_queues(cluster: ClusterGroup, per_shard: int = 2) -> dict[int, list[str]]:
    """Queue names, `per_shard` of them owned by each shard (by port), found by asking the cluster
    which node serves each candidate's slot."""
    by_port: dict[int, list[str]] = {node.port: [] for node in cluster.nodes}
    i = 0
    while any(len(names) < per_shard for names in by_port.values()):
        name = f"scale{i}"
        i += 1
        owner = by_port[cluster.owner(cluster.keyslot(keys.stream(name)))]
        if len(owner) < per_shard:
            owner.append(name)
    return by_port


async def fill_queues(queue: JobQueue, names: list[str], per_queue: int) -> None:
    for name in names:
        spec = JobSpec(argv=("true",), queue=name)
        for start in range(0, per_queue, 1000):
            await queue.enqueue_many([spec] * min(1000, per_queue - start))


@dataclass
class Mark:
    """Where a measured window opens or closes: monotonic and wall time, this process's CPU
    seconds, the whole machine's busy CPU seconds, each shard's `Shard.sample`, the tally."""

    at: float
    wall: float
    mine: float
    busy: float
    shards: list[tuple[float, int, int]]
    tally: collections.Counter[str]


async def mode_point(
    mode: str,
    queue: JobQueue,
    shards: list[Shard],
    names: list[str],
    *,
    workers: int,
    jobs: int,
    seconds: float,
    heartbeat: float,
    job_seconds: float,
) -> dict[str, Any]:
    """`workers` simulated workers spread over the queues `names` (worker i serves names[i % n]),
    against the redis-servers `shards` (one, or a cluster's primaries), each emptied first. The
    workers start within `job_seconds` of each other, and the measured window of `seconds` opens
    once every one has started (a steady flow, not the burst of every slot's first claim)."""
    for shard in shards:
        shard.info.flushall()  # redis-servers of the bench's own, never shared ones
    await fill_queues(queue, names, jobs // len(names))
    me = psutil.Process()
    claims: list[float] = []
    tally: collections.Counter[str] = collections.Counter()
    marks: list[Mark] = []

    async def mark() -> None:
        """Where the window opens or closes (see Mark)."""
        cpu, machine_cpu = me.cpu_times(), psutil.cpu_times()
        busy = sum(getattr(machine_cpu, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq"))
        sampled = await asyncio.to_thread(lambda: [shard.sample() for shard in shards])
        marks.append(Mark(time.monotonic(), time.time(), cpu.user + cpu.system, busy, sampled, tally.copy()))

    async def window() -> None:
        await asyncio.sleep(job_seconds)
        claims.clear()  # the claims of the warm-up
        await mark()
        await asyncio.sleep(seconds)
        await mark()

    stop = time.monotonic() + job_seconds + seconds
    await asyncio.gather(
        window(),
        *(
            simulated_worker(
                queue,
                stop,
                heartbeat,
                job_seconds,
                claims,
                name=names[i % len(names)],
                start_within=job_seconds,
                tally=tally,
            )
            for i in range(workers)
        ),
    )
    start, end = marks
    elapsed = end.at - start.at
    reaper = []
    for _ in range(5):
        r0 = time.perf_counter()
        await queue.reclaim(names)
        reaper.append(time.perf_counter() - r0)
    per_shard: list[dict[str, Any]] = [
        {
            "shard": shard.label,
            "holds": shard.holds,
            "commands_per_s": (c1 - c0 - 2) / elapsed,  # less the INFOs of the first sample
            "cpu_share": (cpu1 - cpu0) / elapsed,
            "connections": n - 1,
        }
        for shard, (cpu0, c0, _), (cpu1, c1, n) in zip(shards, start.shards, end.shards, strict=True)
    ]
    return {
        "mode": mode,
        "workers": workers,
        "queues": names,
        "seconds": elapsed,
        "window": [start.wall, end.wall],
        "jobs_done_per_s": (end.tally["jobs_done"] - start.tally["jobs_done"]) / elapsed,
        "heartbeats_per_s": (end.tally["heartbeats"] - start.tally["heartbeats"]) / elapsed,
        "commands_per_s": sum(s["commands_per_s"] for s in per_shard),
        "cpu_share": sum(s["cpu_share"] for s in per_shard),
        "client_cpu_share": (end.mine - start.mine) / elapsed,
        # the machine's busy CPU less this process's and the shards': anything else running
        "others_cpu_share": (end.busy - start.busy - (end.mine - start.mine)) / elapsed
        - sum(s["cpu_share"] for s in per_shard),
        "claim_ms": summary_ms(claims),
        "reaper_pass_ms": summary_ms(reaper),
        "shards": per_shard,
    }


def pool_share(point: dict[str, Any]) -> dict[str, float]:
    """What the pool-wide keys cost their shard: its commands/s and CPU share over the mean of the
    shards without them (every shard holds the same number of queues and workers)."""
    pool = next(s for s in point["shards"] if "{pool}" in s["holds"])
    rest = [s for s in point["shards"] if s is not pool]
    out = {k: pool[k] - statistics.mean(s[k] for s in rest) for k in ("commands_per_s", "cpu_share")}
    beats = point["heartbeats_per_s"]
    out["commands_per_heartbeat"] = out["commands_per_s"] / beats
    out["cpu_us_per_heartbeat"] = out["cpu_share"] / beats * 1e6
    return out


async def compare(
    workers: int,
    *,
    jobs: int,
    seconds: float,
    heartbeat: float,
    job_seconds: float,
    rounds: int,
    idle_seconds: float = 3.0,
) -> dict[str, Any]:
    """One Redis and a three-shard Cluster, the same workers and queues, alternated `rounds`
    times (one Redis first in odd rounds, the Cluster first in even ones)."""
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp, ClusterGroup(Path(tmp) / "cluster") as cluster:
        by_port = spread_queues(cluster)
        # interleaved by shard, so that workers spread round-robin load every shard alike
        names = [name for group in zip(*by_port.values(), strict=True) for name in group]
        pool_port = cluster.owner(cluster.keyslot(keys.WORKERS))
        cluster_shards = []
        for i, node in enumerate(cluster.nodes):
            assert node.proc is not None
            holds = [*by_port[node.port], *(["{pool}"] if node.port == pool_port else [])]
            cluster_shards.append(Shard(f"shard {'ABC'[i]}", node.proc.pid, cluster.client(node), holds))
        server = EmbeddedRedis(Path(tmp) / "single")
        server.start()
        assert server.pid is not None
        single = Shard(
            "one Redis",
            server.pid,
            redis_sync.Redis(host=server.host, port=server.port, password=server.password),
            [*names, "{pool}"],
        )
        try:
            version = str(single.info.info("server")["redis_version"])
            every = [single, *cluster_shards]
            before = [shard.sample()[0] for shard in every]
            await asyncio.sleep(idle_seconds)  # what each server costs doing nothing (cron, cluster bus)
            idle = {
                shard.label: (shard.sample()[0] - cpu0) / idle_seconds
                for shard, cpu0 in zip(every, before, strict=True)
            }
            runs: dict[str, list[dict[str, Any]]] = {"single": [], "cluster": []}
            for r in range(rounds):
                for mode in ("single", "cluster") if r % 2 == 0 else ("cluster", "single"):
                    client: Redis | RedisCluster
                    if mode == "single":  # as `point` makes it
                        client = Redis.from_pool(
                            BlockingConnectionPool(
                                host=server.host,
                                port=server.port,
                                password=server.password,
                                max_connections=64,
                            )
                        )
                        shards = [single]
                    else:  # as the pool makes it (connection.connect_cluster)
                        # redis-py's default of 100 connections a node raises MaxConnectionsError
                        # rather than wait; at 5 000 simulated workers the heartbeats in flight pass it
                        client = ClusterServer(cluster).client(max_connections=max(100, workers))
                        shards = cluster_shards
                    try:
                        runs[mode].append(
                            await mode_point(
                                mode,
                                JobQueue(client, lease_seconds=30),
                                shards,
                                names,
                                workers=workers,
                                jobs=jobs,
                                seconds=seconds,
                                heartbeat=heartbeat,
                                job_seconds=job_seconds,
                            )
                        )
                    finally:
                        await client.aclose()
        finally:
            for shard in [single, *cluster_shards]:
                shard.info.close()
            server.stop()
    return {
        "machine": machine(version),
        "rounds": rounds,
        "workers": workers,
        "queued": jobs,
        "seconds": seconds,
        "heartbeat": heartbeat,
        "job_seconds": job_seconds,
        "idle_cpu_share": idle,
        "load_average_before": load,  # the machine's, a check that nothing else was running
        "single": median_point(runs["single"]),
        "cluster": median_point(runs["cluster"]),
        "runs": runs,
    }


def median_point(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds' medians of every number (per shard, shard by shard), and the `{pool}` share."""
    first = runs[0]
    out: dict[str, Any] = {"mode": first["mode"], "workers": first["workers"], "queues": first["queues"]}
    for k in (
        "jobs_done_per_s",
        "heartbeats_per_s",
        "commands_per_s",
        "cpu_share",
        "client_cpu_share",
        "others_cpu_share",
    ):
        out[k] = statistics.median(r[k] for r in runs)
    for k in ("claim_ms", "reaper_pass_ms"):
        out[k] = {q: statistics.median(r[k][q] for r in runs) for q in first[k]}
    out["shards"] = [
        {
            "shard": shard["shard"],
            "holds": shard["holds"],
            **{
                k: statistics.median(r["shards"][i][k] for r in runs)
                for k in ("commands_per_s", "cpu_share", "connections")
            },
        }
        for i, shard in enumerate(first["shards"])
    ]
    if len(out["shards"]) > 1:
        out["pool_share"] = pool_share(out)
    return out


def print_compare(result: dict[str, Any]) -> None:
    table = Table(
        title=f"one Redis vs a three-shard Cluster: {result['workers']:,} simulated workers x 2 slots, "
        f"{len(result['single']['queues'])} queues, heartbeat {result['heartbeat']:g} s, "
        f"jobs {result['job_seconds']:g} s, medians of {result['rounds']}"
    )
    for column in (
        "",
        "Redis cmd/s",
        "Redis CPU",
        "conns",
        "claim p50 ms",
        "p99",
        "jobs/s",
        "beats/s",
        "client CPU",
        "others CPU",
    ):
        table.add_column(column, justify="right")
    idle = result["idle_cpu_share"]
    for mode in ("single", "cluster"):
        pt = result[mode]
        if len(pt["shards"]) > 1:
            for shard in pt["shards"]:
                holds = f"{sum(1 for h in shard['holds'] if h != '{pool}')} queues"
                holds += " + {pool}" if "{pool}" in shard["holds"] else ""
                cpu = f"{shard['cpu_share']:.1%} (idle {idle[shard['shard']]:.1%})"
                table.add_row(
                    f"{shard['shard']}: {holds}",
                    f"{shard['commands_per_s']:,.0f}",
                    cpu,
                    f"{shard['connections']:.0f}",
                    *[""] * 6,
                )
        table.add_row(
            "one Redis" if mode == "single" else "Cluster, all shards",
            f"{pt['commands_per_s']:,.0f}",
            f"{pt['cpu_share']:.1%}" + (f" (idle {idle['one Redis']:.1%})" if mode == "single" else ""),
            f"{sum(shard['connections'] for shard in pt['shards']):.0f}",
            f"{pt['claim_ms']['p50']:.2f}",
            f"{pt['claim_ms']['p99']:.2f}",
            f"{pt['jobs_done_per_s']:,.0f}",
            f"{pt['heartbeats_per_s']:,.0f}",
            f"{pt['client_cpu_share']:.0%}",
            f"{pt['others_cpu_share']:.0%}",
        )
    console = Console(width=max(140, Console().width))
    console.print(table)
    share = result["cluster"]["pool_share"]
    console.print(
        f"{{pool}} on its shard (its excess over the other shards' mean): {share['commands_per_s']:,.0f} "
        f"cmd/s, {share['cpu_share']:.1%} CPU; {share['commands_per_heartbeat']:.1f} commands and "
        f"{share['cpu_us_per_heartbeat']:.0f} us of CPU a heartbeat"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workers", default="100,300,1000", help="pool sizes to simulate, comma-separated")
    p.add_argument("--jobs", type=int, default=100_000, help="jobs queued before each point")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--heartbeat", type=float, default=3.0, help="seconds between a worker's heartbeats")
    p.add_argument("--job-seconds", type=float, default=5.0, help="how long each simulated job runs")
    p.add_argument("--quick", action="store_true", help="100 and 1 000 workers, 20 000 jobs, 8 s each")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="instead: one Redis against a three-shard Cluster (--cluster-workers, --cluster-seconds, "
        "--rounds; 24 jobs a worker queued over six queues, twice what the window takes)",
    )
    p.add_argument("--cluster-workers", type=int, default=1000)
    p.add_argument(
        "--cluster-seconds", type=float, default=20.0, help="measured, per mode and round (after a warm-up)"
    )
    p.add_argument("--rounds", type=int, default=1, help="--cluster: rounds of both modes, medians")
    args = p.parse_args(argv)
    if args.cluster:
        result = uvloop.run(
            compare(
                args.cluster_workers,
                jobs=24 * args.cluster_workers,
                seconds=args.cluster_seconds,
                heartbeat=args.heartbeat,
                job_seconds=args.job_seconds,
                rounds=args.rounds,
            )
        )
        print_compare(result)
        name = "scale_cluster" if args.cluster_workers == 1000 else f"scale_cluster_{args.cluster_workers}"
        print(f"wrote {save(name, result)}")
        return
    sizes = [100, 1000] if args.quick else [int(n) for n in args.workers.split(",")]
    jobs, seconds = (20_000, 8.0) if args.quick else (args.jobs, args.seconds)
    result = uvloop.run(measure(sizes, jobs, seconds, args.heartbeat, args.job_seconds))
    table = Table(
        title=f"scale: simulated workers x 2 slots, heartbeat {args.heartbeat:g} s, {jobs:,} queued"
    )
    for column in (
        "workers",
        "Redis cmd/s",
        "Redis CPU",
        "B/queued job",
        "claim p50 ms",
        "claim p99 ms",
        "reaper pass ms",
        "jobs done",
    ):
        table.add_column(column, justify="right")
    for pt in result["points"]:
        table.add_row(
            str(pt["workers"]),
            f"{pt['redis_commands_per_s']:,.0f}",
            f"{pt['redis_cpu_share']:.0%}",
            f"{pt['memory_per_queued_job_bytes']:,.0f}",
            f"{pt['claim_ms']['p50']:.2f}",
            f"{pt['claim_ms']['p99']:.2f}",
            f"{pt['reaper_pass_ms']['p50']:.2f}",
            f"{pt['jobs_done']:,}",
        )
    console = Console()
    console.print(table)
    many = Table(title="many queues: server calls over all queues (median ms) and the idle events reader")
    for column in (
        "queues",
        "reaper pass",
        "one queue at a time",
        "depths",
        "one queue at a time",
        "reader cmd/s",
    ):
        many.add_column(column, justify="right")
    for q in result["queues"]:
        many.add_row(
            str(q["queues"]),
            f"{q['reaper_pass_ms']['p50']:.2f}",
            f"{q['reaper_one_by_one_ms']['p50']:.2f}",
            f"{q['depths_ms']['p50']:.2f}",
            f"{q['depths_one_by_one_ms']['p50']:.2f}",
            f"{q['idle_events_reader_commands_per_s']:.1f}",
        )
    console.print(many)
    print(f"wrote {save('scale', result)}")


if __name__ == "__main__":
    main()
