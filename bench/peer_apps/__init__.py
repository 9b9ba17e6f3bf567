"""Task modules for bench/peers.py: one no-op handler per peer, importable by its worker process.

Each reads the Redis URL from BENCH_REDIS_URL at import. The handler records when it started:
latency jobs (tag "L...") write their start time to the hash `bench:start`; drain jobs count in
the process and write `bench:first`, `bench:last` and `bench:n` once, when BENCH_N were handled
(or on every job when BENCH_PER_JOB=1, for workers that fork a process per job).
"""

from __future__ import annotations

import os
import time

import redis

_count = 0
_first = 0.0
_client: redis.Redis | None = None


def url() -> str:
    return os.environ["BENCH_REDIS_URL"]


def _redis() -> redis.Redis:
    global _client  # noqa: PLW0603 - one client per worker process
    if _client is None:
        _client = redis.Redis.from_url(url())
    return _client


def record(tag: str) -> None:
    global _count, _first  # noqa: PLW0603
    now = time.time()
    if tag.startswith("L"):
        _redis().hset("bench:start", tag, now)
        return
    _count += 1
    if _count == 1:
        _first = now
    if os.environ.get("BENCH_PER_JOB") == "1":
        with _redis().pipeline(transaction=False) as pipe:
            pipe.setnx("bench:first", now)
            pipe.set("bench:last", now)
            pipe.incr("bench:n")
            pipe.execute()
    elif _count == int(os.environ["BENCH_N"]):
        _redis().mset({"bench:first": _first, "bench:last": now, "bench:n": _count})
