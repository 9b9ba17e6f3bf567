"""A bench-only no-op worker process: `python -m bench.noop_worker PORT PASSWORD QUEUE SLOTS`.

Connects, prints `ready`, waits for a line on stdin, then starts a real `Worker` with SLOTS slots
and the no-op executor (bench/noop.py) on QUEUE, lets it drain the queue, and prints
`{"first": t, "last": t, "done": n}` (time.time() of the first start and of the last completion
recorded). Used by throughput.py.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import orjson
import uvloop
from redis.asyncio import Redis

from bench.noop import noop_worker, record_completions
from daemon.queue import keys
from daemon.queue.job_queue import JobQueue

IDLE_SECONDS = 0.5  # the queue is drained: nothing queued or running for this long


async def drain(port: int, password: str, queue_name: str, slots: int) -> None:
    redis = Redis(host="127.0.0.1", port=port, password=password)
    queue = JobQueue(redis)
    await redis.ping()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    name = queue_name
    started: dict[str, float] = {}
    done: dict[str, float] = {}
    record_completions(queue, done)
    # time.time() = perf_counter() + offset, so that processes can be compared
    offset = time.time() - time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        worker = noop_worker(queue, Path(tmp), queue_name, slots, started)
        await worker.start()
        idle_since = None
        while idle_since is None or time.monotonic() - idle_since < IDLE_SECONDS:
            await asyncio.sleep(0.05)
            busy = worker.running or await queue.depth(queue_name) or await redis.zcard(keys.leases(name))
            idle_since = None if busy else (idle_since or time.monotonic())
        await worker.stop(drain_timeout=0)
    result = {"first": min(started.values()) + offset, "last": max(done.values()) + offset, "done": len(done)}
    print(orjson.dumps(result).decode(), flush=True)
    await redis.aclose()


if __name__ == "__main__":
    uvloop.run(drain(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])))
