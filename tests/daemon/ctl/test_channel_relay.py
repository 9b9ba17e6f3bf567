"""Issue 49: a channel's relay through Redis, its speed and its ends, end to end: a real pool
server, a real `poold --worker` running jobs as slot uids (test_exec.py's), and `poolctl` as a
subprocess."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from daemon.queue import channels
from daemon.queue.embedded_redis import EmbeddedRedis
from tests.daemon.ctl.test_exec import running_job
from tests.support.paths import ROOT
from tests.support.proxy import Proxy

FAR = 0.05  # seconds each Redis reply takes to reach the worker: a Redis a network away
OUTPUT = 2 * 2**20  # 32 entries of output, 8 windows


@contextmanager
def far_redis(redis_server: EmbeddedRedis) -> Iterator[Proxy]:
    """A proxy to `redis_server` on a loop of its own (the worker's teardown blocks the test's)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    proxy = Proxy(redis_server.port)
    asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(10)
    try:
        yield proxy
    finally:
        asyncio.run_coroutine_threadsafe(proxy.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def test_output_moves_more_than_an_entry_per_round_trip(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    """Issue 49, the relay's speed (forwarded throughput): a worker whose Redis answers FAR late
    relays 2 MiB of an exec's output (32 entries) in less than a round trip per entry: it writes
    its entries without waiting for Redis between them (deletes ride with them), and the server
    acknowledges what it takes at once, in a write it does not wait for. (A worker that waited
    for each append, and a server that acknowledged only after sending, took ~2.2 s here.)"""
    with far_redis(redis_server) as proxy:
        job = running_job(redis_server, tmp_path, s3_env, worker_options=("--redis-port", str(proxy.port)))
        async with job as (pool, job_id, _):
            proxy.delay(FAR)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "daemon.ctl.cli", "exec", job_id, "--",
                "head", "-c", str(OUTPUT), "/dev/zero",
                env={**pool.env("alice"), "PYTHONPATH": str(ROOT)}, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            assert proc.stdout is not None
            first = await asyncio.wait_for(proc.stdout.read(1), 30)
            began = time.monotonic()
            rest = await asyncio.wait_for(proc.stdout.read(), 30)
            took = time.monotonic() - began
            proxy.delay(0)
            assert await asyncio.wait_for(proc.wait(), 10) == 0
            assert len(first + rest) == OUTPUT
            entries = OUTPUT // channels.READ_CHUNK
            print(f"{OUTPUT >> 20} MiB in {took:.2f} s with Redis {FAR * 1000:g} ms away", file=sys.stderr)
            assert took < entries * FAR, f"{took:.2f} s: a round trip per entry or more"
