"""The spawn ceiling, in a fresh process: `python -m bench.spawn_ceiling JOBS CONCURRENCY LOOP`.

A bare loop running `true` (asyncio.create_subprocess_exec, output piped, new session, then
communicate), CONCURRENCY at a time, on LOOP (`asyncio` or `uvloop`); prints
`{"jobs": n, "seconds": s, "jobs_per_s": r}`. The standard asyncio loop starts children with
vfork (CPython's subprocess without preexec_fn); uvloop forks, which costs more as the parent
grows. A fresh process keeps the bench's own size out of it; the worker is a process of its own too.
"""

from __future__ import annotations

import asyncio
import sys
import time

import orjson
import uvloop


async def spawn_loop(jobs: int, concurrency: int) -> dict[str, float]:
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            proc = await asyncio.create_subprocess_exec(
                "true",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
            await proc.communicate()

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(jobs)))
    span = time.perf_counter() - t0
    return {"jobs": jobs, "seconds": span, "jobs_per_s": jobs / span}


if __name__ == "__main__":
    jobs, concurrency, loop = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    run = uvloop.run if loop == "uvloop" else asyncio.run
    print(orjson.dumps(run(spawn_loop(jobs, concurrency))).decode())
