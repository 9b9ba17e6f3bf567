"""Submissions refused before the pool's Redis is full (issue 44 item 6).

At its `maxmemory` (noeviction) Redis refuses every script that adds (_lib.lua, memory), which the
pool survives; but a Redis that is full refuses the pool's own small writes too, and one user's
submissions could bring it there for everyone. So the server refuses new jobs from FULL of
`maxmemory`, leaving the rest for what is already in the pool: leases, outcomes, logs, cancels,
which go on working, as reads do. It reads `used_memory` and `maxmemory` (INFO memory, a call of
its own to Redis) at most once every READ_EVERY seconds, however many
submissions come; a Redis without a `maxmemory` (a shared one whose operator set none:
docs/OPERATIONS.md says to) is never judged full here. On a Redis Cluster the fullest primary
speaks for all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from daemon.errors import GpupoolError
from daemon.queue.connection import AnyRedis
from protocol import ErrorCode

log = logging.getLogger(__name__)

FULL = 0.9  # of maxmemory: no new job is taken from here on
READ_EVERY = 1.0  # seconds: the most often Redis's memory is asked for


class RedisRoom:
    """Whether the pool's Redis has room for new jobs, as of its last reading."""

    def __init__(self, redis: AnyRedis, *, full: float = FULL, every: float = READ_EVERY) -> None:
        self.redis = redis
        self.full = full
        self.every = every
        self.used = 0  # bytes, at the last reading
        self.most = 0  # maxmemory at the last reading (0: none)
        self._read_at = -float("inf")
        self._reading: asyncio.Future[None] | None = None

    async def check(self) -> None:
        """A GpupoolError (RESOURCE_EXHAUSTED: the submission refused whole, before any of it was
        written) when Redis holds FULL of its maxmemory or more."""
        if time.monotonic() - self._read_at >= self.every:
            if self._reading is None or self._reading.done():
                self._reading = asyncio.ensure_future(self._read())
            await asyncio.shield(self._reading)
        if self.most and self.used >= self.full * self.most:
            raise GpupoolError(
                f"the pool's Redis is full, or nearly ({_size(self.used)} of its {_size(self.most)} "
                "maxmemory in use): nothing of this submission was queued, and no new job is taken "
                "until jobs' records expire and free it; cancels and "
                "running jobs go on. Retry later, and tell the pool's admin (redis_max_memory, or "
                "the shared Redis's maxmemory)",
                ErrorCode.RESOURCE_EXHAUSTED,
            )

    async def _read(self) -> None:
        try:
            if isinstance(self.redis, RedisCluster):
                info: Any = await self.redis.info("memory", target_nodes=RedisCluster.PRIMARIES)
            else:
                info = await self.redis.info("memory")
        except RedisError as exc:  # judged by the last reading; the submission meets Redis anyway
            log.debug("could not read the memory of the pool's Redis (%s)", exc)
            return
        finally:
            self._read_at = time.monotonic()
        nodes = [info] if "used_memory" in info else [v for v in info.values() if isinstance(v, Mapping)]
        readings = [(int(n.get("used_memory", 0)), int(n.get("maxmemory", 0))) for n in nodes]
        capped = [(used, most) for used, most in readings if most]
        self.used, self.most = max(capped, key=lambda r: r[0] / r[1], default=(0, 0))


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes} bytes"
