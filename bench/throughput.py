"""Drain throughput: N jobs pre-queued, drained by 1 and by 2 worker processes; with the raw ceilings.

Against one embedded redis-server started for the run:

- `noop` workers: `python -m bench.noop_worker` processes: a real Worker each, with the bench's
  no-op executor (no process run), 2 slots and 8 slots. jobs/s = N / (last complete - first
  start) over all workers.
- `true` command jobs: a real `poold --worker --worker-mode multinode` process with 2 and with 8
  slots (and two of them with 2 slots each). jobs/s = N / (last ended_at - first started_at),
  from the job records (Redis time, ms). Run as root, once more with `job_uid_range`: each job
  switched to its slot's uid as the worker starts it, in its slot's cgroup where the kernel has
  them (`..._slot_uids`: the cost of isolation).
- ceiling, spawn: a bare loop running `true` (create_subprocess_exec + communicate), as many at
  a time as the worker has slots, in a fresh process (bench/spawn_ceiling.py), on the standard
  asyncio loop (vfork) and on uvloop (fork); the ceiling is the faster, measured right before
  and right after the worker drains it is compared with, in each of `--rounds` rounds (the
  table's last column: the median of the rounds' ratios, command_rounds).
- CPU a job, for each one-worker `true` drain: the worker's own, its jobs' (the children it
  reaped), redis-server's, read from /proc over the drain (from the first poll that finds a job
  taken to the end, against the jobs that ended in it), and how many of the machine's cores all
  three kept busy: on a machine of few cores, a drain is bound by the sum.
- task-spooler, where `tsp` is installed (bench/task_spooler.py): the same `true` jobs drained by
  `tsp -S N` with as many slots, in the same rounds between the same ceilings (at most
  task_spooler.MAX_QUEUED jobs: each job tsp queues holds a client process and a connection).
- ceiling, Redis Streams: a bare redis-py asyncio loop of XADD -> XREADGROUP -> XACK, one message
  at a time, and batched (100 XADDs pipelined, one XREADGROUP COUNT 100, one XACK of 100 ids).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import orjson
import uvloop
from redis.asyncio import Redis
from rich.console import Console
from rich.table import Table

from bench import task_spooler
from bench.common import machine, save
from daemon.job import JobSpec
from daemon.queue import keys
from daemon.queue.embedded_redis import EmbeddedRedis, free_port
from daemon.queue.job_queue import JobQueue
from storage.s3 import S3Store
from tests.support.s3server import S3Server

ROOT = Path(__file__).resolve().parent.parent
LOOPS = ("asyncio", "uvloop")


async def prequeue(queue: JobQueue, name: str, jobs: int) -> list[str]:
    spec = JobSpec(argv=("true",), queue=name)
    ids: list[str] = []
    for start in range(0, jobs, 500):
        ids += await queue.enqueue_many([spec] * min(500, jobs - start))
    return ids


def noop_drain(server: EmbeddedRedis, name: str, workers: int, slots: int) -> dict[str, float]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.noop_worker", str(server.port), server.password, name, str(slots)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            text=True,
        )
        for _ in range(workers)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [orjson.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    done = sum(r["done"] for r in results)
    span = max(r["last"] for r in results) - min(r["first"] for r in results)
    return {"jobs": done, "seconds": span, "jobs_per_s": done / span}


CLOCK_TICK = os.sysconf("SC_CLK_TCK")


class CpuSample(NamedTuple):
    """CPU seconds spent so far, at Redis time `at`: the worker's own, its reaped children's (its
    jobs), redis-server's."""

    at: float  # Redis time, s (as the job records' times)
    worker: float
    jobs: float
    redis: float


def cpu_seconds(pid: int) -> tuple[float, float]:
    """A process's own CPU time and its reaped children's, in seconds (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own, children = int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])
    return own / CLOCK_TICK, children / CLOCK_TICK


async def cpu_sample(redis: Redis, worker_pid: int, redis_pid: int) -> CpuSample:
    seconds, micros = await redis.time()
    worker, jobs = cpu_seconds(worker_pid)
    return CpuSample(seconds + micros / 1e6, worker, jobs, cpu_seconds(redis_pid)[0])


def cpu_per_job(first: CpuSample, last: CpuSample, ends: list[float]) -> dict[str, float]:
    """CPU a job (us) between two samples, over the jobs that ended between them; `cores`: the
    machine's cores the three kept busy meanwhile."""
    jobs = sum(1 for end in ends if first.at < end <= last.at)
    span = last.at - first.at
    if not jobs or span <= 0:
        return {}
    use = {what: getattr(last, what) - getattr(first, what) for what in ("worker", "jobs", "redis")}
    out = {f"{what}_us": 1e6 * seconds / jobs for what, seconds in use.items()}
    return out | {"total_us": 1e6 * sum(use.values()) / jobs, "cores": sum(use.values()) / span}


async def command_drain(  # noqa: PLR0917
    server: EmbeddedRedis,
    queue: JobQueue,
    name: str,
    jobs: int,
    workers: int,
    tmp: Path,
    s3: S3Server,
    uid_range: str = "",
    slots: int = 2,
) -> dict[str, Any]:
    ids = await prequeue(queue, name, jobs)
    if uid_range not in {"", "root"}:
        os.chmod(tmp, 0o711)  # the jobs' uids pass through to their slots (the worker checks it at start)
    env = {
        **os.environ,
        "GPUPOOL_MAIN_SERVER_REDIS_PASSWORD": server.password,
        # A multinode worker refuses to start without its object store.
        "GPUPOOL_MAIN_SERVER_MINIO_ADDRESS": f"127.0.0.1:{s3.port}",
        "GPUPOOL_MAIN_SERVER_MINIO_ACCESS_KEY_ID": s3.access_key,
        "GPUPOOL_MAIN_SERVER_MINIO_SECRET_ACCESS_KEY": s3.secret_key,
        "GPUPOOL_WORKER_REMOTE_PROCESSORS": str(slots),
    }
    procs = []
    for i in range(workers):
        data = tmp / f"worker-{name}-{i}"
        argv = [sys.executable, "-m", "daemon.main", "--worker", "--worker-mode", "multinode"]
        argv += ["--redis-ip", "127.0.0.1", "--redis-port", str(server.port), "--queues", name]
        argv += ["--metrics-listen", "127.0.0.1:0", "--data-dir", str(data), "--log-level", "warning"]
        argv += ["--job-uid-range", uid_range] if uid_range else []  # "root": the bare cost
        log = open(tmp / f"worker-{name}-{i}.log", "wb")  # noqa: SIM115, ASYNC230 - closed below
        procs.append(
            (
                subprocess.Popen(  # noqa: ASYNC220 - a fast fork
                    argv,
                    env=env,
                    cwd=ROOT,
                    stdout=log,
                    stderr=log,
                ),
                log,
            )
        )
    redis = queue.redis
    assert isinstance(redis, Redis), "the bench's pool is one Redis"
    redis_pid = int((await redis.info("server"))["process_id"])
    first: CpuSample | None = None  # once a job is taken (a lone worker's drain)
    last: CpuSample | None = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            depth = await queue.depth(name)
            done = depth == 0 and not await queue.redis.zcard(keys.leases(name))
            if workers == 1:
                last = await cpu_sample(redis, procs[0][0].pid, redis_pid)
                first = first or (last if depth < jobs else None)
            if done:
                break
            await asyncio.sleep(0.05 if workers == 1 else 0.2)  # (a lone worker's CPU sampled closely)
        infos = [await queue.get(j) for j in ids]
    finally:
        for p, log in procs:
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            log.close()
    starts = [i.started_at for i in infos if i.started_at is not None]
    ends = [i.ended_at for i in infos if i.ended_at is not None]
    if not ends:
        raise RuntimeError(
            f"no job finished; worker log: {(tmp / f'worker-{name}-0.log').read_text()[-1000:]}"
        )
    span = max(ends) - min(starts)
    cpu = cpu_per_job(first, last, ends) if first and last else {}
    out: dict[str, Any] = {"jobs": len(ends), "seconds": span, "jobs_per_s": len(ends) / span}
    return out | ({"cpu": cpu} if cpu else {})


async def command_rounds(  # noqa: PLR0917
    server: EmbeddedRedis, queue: JobQueue, tmp: Path, s3: S3Server, jobs: int, slots: int, rounds: int
) -> dict[str, Any]:
    """`true` jobs through one worker with `slots` slots (and, as root, with slot uids), and
    through task-spooler where installed, against the spawn ceiling, in `rounds` rounds. The
    machine's speed drifts by a third within a minute here (a shared VM), so each round measures
    the ceiling right before and right after its drains, and a drain's ratio is to the mean of
    the two; reported: the medians over rounds of each rate and of each ratio (the figure to
    read), and of the worker's ratio to task-spooler's in the same round."""
    root = os.geteuid() == 0  # the bare cost (jobs as root, by choice), then with slot uids
    kinds = {"": "root"} | {"_slot_uids": f"61100-{61100 + slots - 1}"} if root else {"": ""}
    name = f"true_1_worker_{slots}_slots"
    ceilings: list[dict[str, float]] = []
    drains: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    ratios: dict[str, list[float]] = {kind: [] for kind in kinds}
    to_tsp: dict[str, list[float]] = {kind: [] for kind in kinds}
    tsp: list[dict[str, float]] = []
    tsp_ratios: list[float] = []
    best: dict[str, list[dict[str, float]]] = {}
    for i in range(rounds):
        before = await best_spawn(jobs, slots, best)
        if task_spooler.TSP is not None:
            tsp.append(await asyncio.to_thread(task_spooler.drain, min(jobs, task_spooler.MAX_QUEUED), slots))
        for kind, uid_range in kinds.items():
            r = await command_drain(
                server, queue, f"cmd{kind}{slots}x{i}", jobs, 1, tmp, s3, uid_range=uid_range, slots=slots
            )
            drains[kind].append(r)
        after = await best_spawn(jobs, slots, best)
        ceilings += [before, after]
        ceiling = statistics.mean([before["jobs_per_s"], after["jobs_per_s"]])
        for kind in kinds:
            ratios[kind].append(drains[kind][-1]["jobs_per_s"] / ceiling)
            if tsp:
                to_tsp[kind].append(drains[kind][-1]["jobs_per_s"] / tsp[-1]["jobs_per_s"])
        if tsp:
            tsp_ratios.append(tsp[-1]["jobs_per_s"] / ceiling)
    out: dict[str, Any] = {f"ceiling_spawn_true_{loop}_{slots}": median_rate(rs) for loop, rs in best.items()}
    out[f"ceiling_spawn_true_{slots}"] = median_rate(ceilings)
    if tsp:
        out[f"task_spooler_{slots}_slots"] = median_rate(tsp) | {"ratio": statistics.median(tsp_ratios)}
    for kind in kinds:
        out[name + kind] = median_rate(drains[kind]) | {"ratio": statistics.median(ratios[kind])}
        if cpus := [r["cpu"] for r in drains[kind] if "cpu" in r]:
            out[name + kind]["cpu"] = {what: statistics.median(c[what] for c in cpus) for what in cpus[0]}
        if tsp:
            out[name + kind]["to_task_spooler"] = statistics.median(to_tsp[kind])
    return out


async def best_spawn(jobs: int, slots: int, seen: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    """The spawn ceiling now: the faster of the loops (each kept in `seen`)."""
    results = []
    for loop in LOOPS:
        r = await asyncio.to_thread(spawn_ceiling, jobs, slots, loop)
        seen.setdefault(loop, []).append(r)
        results.append(r)
    return max(results, key=lambda r: r["jobs_per_s"])


def median_rate(results: list[dict[str, float]]) -> dict[str, Any]:
    """The median of several runs' rates (with the jobs of one run), and every rate."""
    rates = [r["jobs_per_s"] for r in results]
    return {"jobs": results[0]["jobs"], "jobs_per_s": statistics.median(rates), "rounds": rates}


def spawn_ceiling(jobs: int, concurrency: int, loop: str) -> dict[str, float]:
    argv = [sys.executable, "-m", "bench.spawn_ceiling", str(jobs), str(concurrency), loop]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, check=True, text=True, timeout=300).stdout
    result: dict[str, float] = orjson.loads(out)
    return result


async def streams_ceiling(redis: Redis, messages: int, batch: int) -> dict[str, float]:
    stream, group = f"ceiling-{batch}", "g"
    await redis.xgroup_create(stream, group, id="0", mkstream=True)
    t0 = time.perf_counter()
    for _ in range(0, messages, batch):
        if batch == 1:
            await redis.xadd(stream, {"job": "x"})
        else:
            async with redis.pipeline(transaction=False) as pipe:
                for _ in range(batch):
                    pipe.xadd(stream, {"job": "x"})
                await pipe.execute()
        got: Any = await redis.xreadgroup(group, "c", {stream: ">"}, count=batch)
        await redis.xack(stream, group, *[entry_id for entry_id, _ in got[0][1]])
    span = time.perf_counter() - t0
    return {"jobs": messages, "seconds": span, "jobs_per_s": messages / span}


async def measure(jobs: int, command_jobs: int, rounds: int, commands_only: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        server = EmbeddedRedis(tmp, port=free_port())
        server.start()
        try:
            redis = server.client()
            version = (await redis.info("server"))["redis_version"]
            queue = JobQueue(redis)
            for slots in () if commands_only else (2, 8):
                for workers in (1, 2):
                    name = f"noop{workers}x{slots}"
                    await prequeue(queue, name, jobs)
                    out[f"noop_{workers}_worker_{slots}_slots"] = await asyncio.to_thread(
                        noop_drain, server, name, workers, slots
                    )
            (tmp / "s3").mkdir()
            s3 = S3Server(tmp / "s3")  # SeaweedFS, as the tests use: the workers' object store
            await asyncio.to_thread(s3.start)
            try:
                store = S3Store(f"127.0.0.1:{s3.port}", "gpupool", s3.access_key, s3.secret_key)
                await store.open()
                await store.ensure_bucket()
                await store.close()
                for slots in (2, 8):
                    out.update(await command_rounds(server, queue, tmp, s3, command_jobs, slots, rounds))
                if not commands_only:
                    out["true_2_workers_2_slots"] = await command_drain(
                        server, queue, "cmd2w", command_jobs, 2, tmp, s3
                    )
            finally:
                await asyncio.to_thread(s3.stop)
            if not commands_only:
                out["ceiling_streams_unbatched"] = await streams_ceiling(redis, jobs, 1)
                out["ceiling_streams_batch100"] = await streams_ceiling(redis, jobs * 5, 100)
            await redis.aclose()
        finally:
            server.stop()
    return {
        "machine": machine(str(version)),
        "jobs": jobs,
        "command_jobs": command_jobs,
        "rounds": rounds,
        "rates": out,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=5000, help="no-op jobs (and ceiling messages)")
    p.add_argument("--command-jobs", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3, help="rounds of command jobs against the ceiling")
    p.add_argument("--quick", action="store_true", help="2000 no-op, 300 command jobs, 1 round")
    p.add_argument(
        "--commands-only", action="store_true", help="only `true` jobs, the ceiling and task-spooler"
    )
    args = p.parse_args(argv)
    jobs, command_jobs = (2000, 300) if args.quick else (args.jobs, args.command_jobs)
    result = uvloop.run(measure(jobs, command_jobs, 1 if args.quick else args.rounds, args.commands_only))
    t = Table(title="drain throughput, pre-queued jobs, embedded Redis")
    t.add_column("what")
    t.add_column("jobs", justify="right")
    t.add_column("jobs/s", justify="right")
    t.add_column("/ spawn ceiling", justify="right")
    t.add_column("/ task-spooler", justify="right")
    rates = result["rates"]
    for name, r in rates.items():
        # command jobs: the median of their rounds' ratios (command_rounds), else to the median ceiling
        slots = next((n for n in (2, 8) if name.startswith("true_") and f"_{n}_slots" in name), None)
        ratio = r.get("ratio") or (
            r["jobs_per_s"] / rates[f"ceiling_spawn_true_{slots}"]["jobs_per_s"] if slots else None
        )
        to_tsp = r.get("to_task_spooler")
        t.add_row(
            name,
            str(r["jobs"]),
            f"{r['jobs_per_s']:,.0f}",
            f"{ratio:.2f}" if ratio else "",
            f"{to_tsp:.2f}" if to_tsp else "",
        )
    Console().print(t)
    if cpu := {name: r["cpu"] for name, r in rates.items() if "cpu" in r}:
        c = Table(title="CPU a job while a worker drains (us; medians of the rounds)")
        for column in ("what", "worker", "its jobs", "redis-server", "all", "cores busy"):
            c.add_column(column, justify="left" if column == "what" else "right")
        for name, u in cpu.items():
            c.add_row(
                name,
                *(f"{u[k]:,.0f}" for k in ("worker_us", "jobs_us", "redis_us", "total_us")),
                f"{u['cores']:.2f}",
            )
        Console().print(c)
    print(f"wrote {save('throughput', result)}")


if __name__ == "__main__":
    main()
