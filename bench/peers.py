"""Peers on the same machine and the same redis-server: Celery, RQ, SAQ, Dramatiq (arq: see README).

For each peer configuration, against one redis-server started for the run (EmbeddedRedis) and
flushed between configurations, with one worker process (a subprocess, killed at the end):

- latency: jobs submitted one at a time, `--gap` apart, to an idle worker; enqueue -> handler
  start (the no-op handler writes time.time() to Redis; the submitter took time.time() before
  its enqueue call). p50/p90/p99/max.
- submit: N no-op jobs enqueued one at a time with the peer's client API (jobs/s), and RQ's bulk
  `Queue.enqueue_many` (one pipeline) for the bulk comparison.
- drain: the N jobs pre-queued, then one worker started; jobs/s = N / (last handler end - first
  handler start), as the handlers recorded them.

Configurations (documented defaults unless said): celery (prefork, -c 1), celery-solo (tuned:
--pool solo, no child process), rq (the default forking Worker), rq-simple (SimpleWorker, no fork
per job), saq (defaults: concurrency 10), dramatiq (-p 1, default 8 threads).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from bench.common import machine, save, summary_ms
from daemon.queue.embedded_redis import EmbeddedRedis, free_port

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@dataclass
class Peer:
    name: str
    argv: list[str]
    enqueue: Callable[[str], None]
    bulk: Callable[[list[str]], None] | None = None
    per_job: bool = False  # the worker forks per job: the handler records every job in Redis
    drain_cap: int = 0  # fewer drain jobs for slow workers (0: no cap)
    notes: str = ""
    closers: list[Callable[[], None]] = field(default_factory=list)


def peers(url: str) -> Iterator[Peer]:
    """The configurations, imported lazily (BENCH_REDIS_URL must be set first)."""
    from bench.peer_apps import celery_app

    celery = [str(BIN / "celery"), "-A", "bench.peer_apps.celery_app", "worker", "-Q", "bench"]
    celery += ["-l", "warning", "--without-gossip", "--without-mingle", "--without-heartbeat"]

    def celery_enqueue(tag: str) -> None:
        celery_app.noop.delay(tag)

    yield Peer("celery", [*celery, "-c", "1"], celery_enqueue, notes="prefork, 1 child")
    yield Peer("celery-solo", [*celery, "-P", "solo"], celery_enqueue, notes="tuned: --pool solo")

    import rq

    from bench.peer_apps import rq_app

    conn = redis.Redis.from_url(url)
    q = rq.Queue("bench", connection=conn)

    def rq_enqueue(tag: str) -> None:
        q.enqueue(rq_app.noop, tag)

    def rq_bulk(tags: list[str]) -> None:
        q.enqueue_many([rq.Queue.prepare_data(rq_app.noop, (t,)) for t in tags])

    rq_worker = [str(BIN / "rq"), "worker", "--url", url, "bench", "--logging_level", "WARNING"]
    yield Peer("rq", rq_worker, rq_enqueue, rq_bulk, per_job=True, drain_cap=300, notes="forking Worker")
    yield Peer(
        "rq-simple", [*rq_worker, "-w", "rq.worker.SimpleWorker"], rq_enqueue, rq_bulk, notes="SimpleWorker"
    )

    from bench.peer_apps import saq_app

    loop = asyncio.new_event_loop()

    def saq_enqueue(tag: str) -> None:
        loop.run_until_complete(saq_app.queue.enqueue("noop", tag=tag))

    saq = Peer("saq", [str(BIN / "saq"), "bench.peer_apps.saq_app.settings"], saq_enqueue, notes="defaults")
    saq.closers.append(lambda: loop.run_until_complete(saq_app.queue.disconnect()))
    saq.closers.append(loop.close)
    yield saq

    from bench.peer_apps import dramatiq_app

    def dramatiq_enqueue(tag: str) -> None:
        dramatiq_app.noop.send(tag)

    dramatiq = [str(BIN / "dramatiq"), "bench.peer_apps.dramatiq_app", "-p", "1"]
    yield Peer("dramatiq", dramatiq, dramatiq_enqueue, notes="-p 1, 8 threads (default)")


@contextlib.contextmanager
def worker(peer: Peer, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(peer.argv, env=env, cwd=ROOT, stdout=out, stderr=out, start_new_session=True)
        try:
            yield proc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)  # the worker and any children it forked
            proc.wait()


def wait_until(check: Callable[[], bool], limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def run_peer(  # noqa: PLR0917
    peer: Peer, r: redis.Redis, url: str, jobs: int, drain: int, gap: float, tmp: Path
) -> dict[str, Any]:
    drain = min(drain, peer.drain_cap) if peer.drain_cap else drain
    env = {**os.environ, "BENCH_REDIS_URL": url, "BENCH_N": str(drain), "PYTHONPATH": str(ROOT)}
    if peer.per_job:
        env["BENCH_PER_JOB"] = "1"
    log = tmp / f"{peer.name}.log"
    out: dict[str, Any] = {"notes": peer.notes, "drain_jobs": drain}
    r.flushall()
    # latency: an idle worker, one job at a time
    with worker(peer, env, log):
        peer.enqueue("Lwarm")
        if not wait_until(lambda: r.hexists("bench:start", "Lwarm"), 60):
            return {**out, "error": f"worker did not start; see {log}"}
        time.sleep(0.3)
        sent: dict[str, float] = {}
        for i in range(jobs):
            tag = f"L{i}"
            sent[tag] = time.time()
            peer.enqueue(tag)
            time.sleep(gap)
        wait_until(lambda: r.hlen("bench:start") >= jobs + 1, 30)
        starts = {k.decode(): float(v) for k, v in r.hgetall("bench:start").items()}  # type: ignore[union-attr]
    out["latency_ms"] = summary_ms([starts[t] - t0 for t, t0 in sent.items() if t in starts])
    r.flushall()
    # submit one at a time (these are the drain jobs), then drain with one fresh worker
    t0 = time.perf_counter()
    for i in range(drain):
        peer.enqueue(f"D{i}")
    out["submit_per_s"] = drain / (time.perf_counter() - t0)
    with worker(peer, env, log):
        wait_until(lambda: int(r.get("bench:n") or 0) >= drain, 180)
        first, last, n = r.mget("bench:first", "bench:last", "bench:n")
    if n is None or int(n) < drain or first is None or last is None:
        out["error"] = f"drained {int(n or 0)} of {drain}; see {log}"
    else:
        out["drain_per_s"] = drain / (float(last) - float(first))
    if peer.bulk is not None:
        r.flushall()
        t0 = time.perf_counter()
        for start in range(0, drain, 100):
            peer.bulk([f"B{i}" for i in range(start, min(drain, start + 100))])
        out["submit_bulk_per_s"] = drain / (time.perf_counter() - t0)
    return out


def measure(jobs: int, drain: int, gap: float, only: list[str] | None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        server = EmbeddedRedis(tmp, port=free_port())
        server.start()
        try:
            url = f"redis://:{server.password}@127.0.0.1:{server.port}/0"
            os.environ["BENCH_REDIS_URL"] = url
            r = redis.Redis.from_url(url)
            version = str(r.info("server")["redis_version"])
            for peer in peers(url):
                if only and peer.name not in only:
                    continue
                try:
                    results[peer.name] = run_peer(peer, r, url, jobs, drain, gap, tmp)
                except Exception as exc:
                    results[peer.name] = {"notes": peer.notes, "error": repr(exc)}
                finally:
                    for close in peer.closers:
                        close()
                print(f"  {peer.name}: done", file=sys.stderr)
            r.close()
        finally:
            server.stop()
    return {"machine": machine(version), "jobs": jobs, "drain_jobs": drain, "gap_s": gap, "peers": results}


def table(result: dict[str, Any]) -> Table:
    t = Table(title=f"peers, one worker process, same redis-server ({result['jobs']} latency jobs)")
    cols = (
        "peer",
        "enq→start p50 ms",
        "p99 ms",
        "max ms",
        "drain jobs/s",
        "submit/s",
        "bulk submit/s",
        "notes",
    )
    for col in cols:
        t.add_column(col, justify="left" if col in ("peer", "notes") else "right")

    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for name, r in result["peers"].items():
        lat = r.get("latency_ms") or {}
        t.add_row(
            name,
            f(lat.get("p50"), ".2f"),
            f(lat.get("p99"), ".2f"),
            f(lat.get("max"), ".2f"),
            f(r.get("drain_per_s"), ",.0f"),
            f(r.get("submit_per_s"), ",.0f"),
            f(r.get("submit_bulk_per_s"), ",.0f"),
            r.get("error") or r.get("notes", ""),
        )
    return t


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=300, help="latency jobs")
    p.add_argument("--drain", type=int, default=2000, help="drain jobs")
    p.add_argument("--gap", type=float, default=0.010)
    p.add_argument("--only", nargs="*", help="peer configurations to run")
    p.add_argument("--quick", action="store_true", help="100 latency jobs, 1000 drain jobs")
    args = p.parse_args(argv)
    jobs, drain = (100, 1000) if args.quick else (args.jobs, args.drain)
    result = measure(jobs, drain, args.gap, args.only)
    Console(width=150).print(table(result))
    print(f"wrote {save('peers', result)}")


if __name__ == "__main__":
    main()
