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
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import uvloop
from redis.asyncio import BlockingConnectionPool, Redis
from rich.console import Console
from rich.table import Table

from bench.common import machine, save, summary_ms
from daemon.aio import cancel_and_wait
from daemon.job import JobSpec, JobState, Lease, Outcome
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.queue.registry import Registration, add_heartbeat, new_worker_id
from daemon.queue.scripts import ScriptBatch
from daemon.queue.terminal_events import JobEvents

DONE = Outcome(JobState.SUCCEEDED, exit_code=0)


async def fill(queue: JobQueue, jobs: int) -> None:
    spec = JobSpec(argv=("true",), queue="scale")
    for start in range(0, jobs, 1000):
        await queue.enqueue_many([spec] * min(1000, jobs - start))


async def simulated_worker(
    queue: JobQueue, stop: float, heartbeat: float, job_seconds: float, claims: list[float]
) -> int:
    reg = Registration(id=new_worker_id("sim"), slots=2, queues=["scale"], healthy_period=30.0)
    running: dict[str, tuple[Lease, float]] = {}
    next_beat = time.monotonic() + random.uniform(0, heartbeat)  # spread the beats
    done = 0
    while (now := time.monotonic()) < stop:
        for job_id, (lease, until) in list(running.items()):
            if now >= until:
                await queue.complete(lease, DONE)
                del running[job_id]
                done += 1
        while len(running) < reg.slots:
            t0 = time.perf_counter()
            got = await queue.claim(reg.id, ["scale"])
            claims.append(time.perf_counter() - t0)
            if got is None:
                break
            running[got.job_id] = (got, time.monotonic() + job_seconds)
        if now >= next_beat:
            reg.running = len(running)
            batch = ScriptBatch(queue.redis)
            add_heartbeat(batch, queue.scripts, reg)
            answers = queue.add_renewals(batch, reg.id, [lease for lease, _ in running.values()])
            answers(await batch.execute())
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workers", default="100,300,1000", help="pool sizes to simulate, comma-separated")
    p.add_argument("--jobs", type=int, default=100_000, help="jobs queued before each point")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--heartbeat", type=float, default=3.0, help="seconds between a worker's heartbeats")
    p.add_argument("--job-seconds", type=float, default=5.0, help="how long each simulated job runs")
    p.add_argument("--quick", action="store_true", help="100 and 1 000 workers, 20 000 jobs, 8 s each")
    args = p.parse_args(argv)
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
