"""The dashboard's pages with 10 000 jobs in the pool: how long the server takes to answer each.

A PoolServer of its own (embedded Redis, no workers) holds `--jobs` jobs of two users in two
queues, a third of them cancelled (so the list mixes queued and ended jobs). Signed in with the
local token, each page is fetched `--runs` times over loopback; the time is request sent → last
byte of the page received, so it is the server's time plus a loopback round trip. The pool view
is read from Redis at most once every two seconds for all viewers (server/web/snapshot.py):
"cold" forces that read on every request (the worst a viewer sees), "warm" is a page served from
the shared read.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import time
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from bench.common import bench_server, machine, save
from daemon import tokens
from daemon.job import JobSpec
from daemon.server.service import PoolServer


async def fill(server: PoolServer, jobs: int) -> str:
    """`jobs` jobs, a third cancelled; returns one job's id."""
    assert server.queue is not None
    me = tokens.local_user()
    specs = [
        JobSpec(
            argv=("python", "train.py", f"--seed={i}"),
            queue=("default", "big")[i % 2],
            user=(me, "bob")[i % 3 == 0],
        )
        for i in range(jobs)
    ]
    ids: list[str] = []
    for start in range(0, jobs, 1000):
        ids += await server.queue.enqueue_many(specs[start : start + 1000])
    for job_id in ids[1::3]:
        await server.queue.cancel(job_id)
    return ids[len(ids) // 2]


async def timed(session: aiohttp.ClientSession, url: str, runs: int) -> dict[str, float]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        async with session.get(url) as response:
            await response.read()
            assert response.status == 200, (url, response.status)
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return {
        "p50_ms": statistics.median(times),
        "p90_ms": times[int(len(times) * 0.9) - 1],
        "max_ms": times[-1],
    }


async def measure(jobs: int, runs: int) -> dict[str, Any]:
    async with bench_server() as server:
        assert server.web is not None
        one = await fill(server, jobs)
        base = server.web.address
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
            token = tokens.client_token()
            async with session.post(f"{base}/signin", data={"token": token or ""}) as r:
                signed_in = r.status == 200 and "Sign out" in await r.text()
                assert signed_in, "cannot sign in with the local token"
            pages = {
                "pool": "/",
                "jobs, first page": "/jobs",
                "jobs, filtered, sorted, page 20": "/jobs?user=bob&state=queued&sort=state&order=asc&page=20",
                "jobs, last page": "/jobs?page=1000",
                "one job": f"/jobs/{one}",
            }
            snapshots = server.web.snapshots
            out: dict[str, Any] = {}
            for name, path in pages.items():
                snapshots.max_age = 0.0  # every request reads the pool again
                cold = await timed(session, base + path, runs)
                snapshots.max_age = 3600.0  # every request shares the last read
                warm = await timed(session, base + path, runs)
                out[name] = {"path": path, "cold": cold, "warm": warm}
            async with session.get(f"{base}/jobs") as r:
                shown = len(re.findall(r"data-job=", await r.text()))
        return {"jobs": jobs, "runs": runs, "rows_per_page": shown, "pages": out, "machine": machine()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.jobs, args.runs))
    save("dashboard", result)
    table = Table(title=f"dashboard pages, {result['jobs']} jobs in the pool (ms, request → last byte)")
    for col in ("page", "cold p50", "cold p90", "warm p50", "warm p90"):
        table.add_column(col)
    for name, r in result["pages"].items():
        c, w = r["cold"], r["warm"]
        table.add_row(
            name, f"{c['p50_ms']:.1f}", f"{c['p90_ms']:.1f}", f"{w['p50_ms']:.1f}", f"{w['p90_ms']:.1f}"
        )
    Console().print(table)


if __name__ == "__main__":
    main()
