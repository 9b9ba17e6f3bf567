"""The pool's Redis: the embedded one (singlenode) or the configured one (multinode): one node at
`redis_ip`, the primary of a Sentinel group (`redis_sentinels`), found again after a failover, or
a Redis Cluster (`redis_cluster_nodes`)."""

from __future__ import annotations

import asyncio
import logging
import os

from redis.asyncio.sentinel import Sentinel
from redis.exceptions import RedisError

from daemon.address import parse_host_ports
from daemon.config import Config
from daemon.errors import RedisUnavailable
from daemon.queue import connection
from daemon.queue.connection import AnyRedis
from daemon.queue.embedded_redis import EmbeddedRedis

log = logging.getLogger(__name__)


def embedded_max_memory(config: Config) -> int:
    """The embedded Redis's maxmemory: `redis_max_memory`, else a quarter of this machine's memory
    (the rest is for the jobs, and for the copy a rewrite of the AOF forks)."""
    if config.redis_max_memory:
        return config.redis_max_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


class PoolRedis:
    """Owns the Redis connection pool, and in singlenode mode the redis-server process too."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.embedded: EmbeddedRedis | None = None
        self.client: AnyRedis | None = None
        self.sentinel: Sentinel | None = None  # asked where the primary is, with redis_sentinels
        # which redis-servers answer (a restart or a failover changes one)
        self.watch = connection.RunIdWatch(per_node=bool(config.redis_cluster_nodes))

    @property
    def address(self) -> str:
        if self.embedded is not None:
            return f"{self.embedded.host}:{self.embedded.port}"
        c = self.config
        if c.redis_cluster_nodes:
            return f"the Redis Cluster of {', '.join(c.redis_cluster_nodes)}"
        if c.redis_sentinels:
            return f"the primary of {c.redis_sentinel_master!r} (sentinels {', '.join(c.redis_sentinels)})"
        return f"{self.config.redis_ip}:{self.config.redis_port}"

    async def start(self) -> AnyRedis:
        c = self.config
        if c.embedded:
            self.embedded = EmbeddedRedis(
                c.data_path(), appendfsync=c.redis_appendfsync, max_memory=embedded_max_memory(c)
            )
            await asyncio.to_thread(self.embedded.start)
            self.client = self.embedded.client(watch=self.watch)
        elif c.redis_sentinels:
            self.client, self.sentinel = connection.connect_sentinel(
                parse_host_ports(c.redis_sentinels),
                c.redis_sentinel_master,
                db=c.redis_db,
                username=c.redis_username or None,
                password=c.main_server_redis_password or None,
                sentinel_password=c.redis_sentinel_password or None,
                watch=self.watch,
            )
        elif c.redis_cluster_nodes:
            self.client = connection.connect_cluster(
                parse_host_ports(c.redis_cluster_nodes),
                username=c.redis_username or None,
                password=c.main_server_redis_password or None,
                watch=self.watch,
            )
        else:
            self.client = connection.connect(
                c.redis_ip,
                c.redis_port,
                db=c.redis_db,
                username=c.redis_username or None,
                password=c.main_server_redis_password or None,
                watch=self.watch,
            )
        try:
            await connection.meet(self.client, self.watch)
        except RedisError as exc:
            where = (
                "redis_cluster_nodes"
                if c.redis_cluster_nodes
                else "redis_sentinels, redis_sentinel_master"
                if c.redis_sentinels
                else "redis_ip, redis_port"
            )
            await self.stop()
            raise RedisUnavailable(
                f"cannot reach Redis at {self.address} ({exc}); check {where} and the passwords"
            ) from None
        return self.client

    async def stop(self) -> None:
        """Close the connections, then stop the embedded redis-server. Safe to call twice."""
        if self.client is not None:
            await self.client.aclose()
            self.client = None
        if self.sentinel is not None:
            await self.sentinel.aclose()
            self.sentinel = None
        if self.embedded is not None:
            await asyncio.to_thread(self.embedded.stop)
            self.embedded = None
