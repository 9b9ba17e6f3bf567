"""A bench-only no-op worker process: `python -m bench.noop_worker PORT PASSWORD QUEUE SLOTS`.

Connects, prints `ready`, waits for a line on stdin, then drains QUEUE with SLOTS concurrent
claim -> complete loops (no process is run: the queue's share of a job) until `claim` finds
nothing, and prints `{"first": t, "last": t, "done": n}` (time.time()). Used by throughput.py.
A daemon hook (an executor seam in Worker) would let this go through Worker's own dispatcher.
"""

from __future__ import annotations

import asyncio
import sys
import time

import orjson
import uvloop
from redis.asyncio import Redis

from daemon.job import JobState, Outcome
from daemon.queue import JobQueue

DONE = Outcome(JobState.SUCCEEDED, exit_code=0)


async def drain(port: int, password: str, queue_name: str, slots: int) -> None:
    redis = Redis(host="127.0.0.1", port=port, password=password)
    queue = JobQueue(redis)
    await redis.ping()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    times: list[float] = []

    async def loop(name: str) -> None:
        while (lease := await queue.claim(name, [queue_name])) is not None:
            if not times:
                times.append(time.time())
            await queue.complete(lease, DONE)
            times.append(time.time())

    await asyncio.gather(*(loop(f"noop-{i}") for i in range(slots)))
    print(orjson.dumps({"first": times[0], "last": times[-1], "done": len(times) - 1}).decode(), flush=True)
    await redis.aclose()


if __name__ == "__main__":
    uvloop.run(drain(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])))
