"""A Redis Cluster on loopback, from the same redis-server binary as the embedded pool: `primaries`
nodes with `cluster-enabled yes`, introduced to each other (CLUSTER MEET) and given the 16 384
slots in equal ranges (CLUSTER ADDSLOTS): what redis-cli --cluster create does, without redis-cli.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from redis.asyncio.cluster import RedisCluster

from daemon.queue.connection import connect_cluster
from daemon.queue.embedded_redis import free_port, port_free
from tests.support.redis_group import Process, RedisGroup

SLOTS = 16384
BUS_OFFSET = 10000  # a node's cluster bus listens on its port + 10 000 (Redis 6.2 has no cluster-port)


def bus_free_port() -> int:
    """A free port whose cluster bus port is free too (and below 65 536)."""
    for _ in range(1000):
        port = free_port()
        if port + BUS_OFFSET < 65536 and port_free(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class ClusterGroup(RedisGroup):
    """`with ClusterGroup(root) as cluster:` a running cluster, its state ok on every node."""

    def __init__(self, root: Path, primaries: int = 3) -> None:
        super().__init__(root)
        self.nodes = [Process(bus_free_port(), root / f"node{i}") for i in range(primaries)]

    def processes(self) -> list[Process]:
        return self.nodes

    def start(self) -> None:
        for node in self.nodes:
            conf = [
                f"port {node.port}",
                "bind 127.0.0.1",
                f"dir {node.dir}",
                f"logfile {node.dir / 'log'}",
                "cluster-enabled yes",
                "cluster-config-file nodes.conf",
                "cluster-node-timeout 1000",
                "appendonly yes",
                'save ""',
                f"requirepass {self.password}",
                f"masterauth {self.password}",
                "maxmemory-policy noeviction",
            ]
            self.launch(node, conf)
        for node in self.nodes:
            self.wait(functools.partial(self.ping, node), f"node on port {node.port}")
        first, share = self.nodes[0], SLOTS // len(self.nodes)
        for i, node in enumerate(self.nodes):
            with self.client(node) as c:
                if node is not first:
                    c.execute_command("CLUSTER MEET", "127.0.0.1", first.port)
                upto = SLOTS if i == len(self.nodes) - 1 else (i + 1) * share
                c.execute_command("CLUSTER ADDSLOTS", *range(i * share, upto))
        self.wait(self._ok, "the cluster's state to be ok on every node")

    def owner(self, slot: int) -> int:
        """The port of the node that serves `slot`."""
        with self.client(self.nodes[0]) as c:
            for start, end, primary, *_ in c.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return int(primary[1])
        raise LookupError(f"no node serves slot {slot}")

    def keyslot(self, key: str) -> int:
        with self.client(self.nodes[0]) as c:
            return int(c.execute_command("CLUSTER KEYSLOT", key))

    def _ok(self) -> bool:
        for node in self.nodes:
            with self.client(node) as c:
                info = c.execute_command("CLUSTER INFO")  # parsed by redis-py into a dict
                if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) != len(
                    self.nodes
                ):
                    return False
        return True


class ClusterServer:
    """A running ClusterGroup seen as the queue's tests see one redis-server (EmbeddedRedis):
    `client()` makes a new client of it (connection.connect_cluster, as the pool does)."""

    def __init__(self, group: ClusterGroup) -> None:
        self.group = group

    def client(self, **kwargs: Any) -> RedisCluster:
        nodes = [("127.0.0.1", node.port) for node in self.group.nodes]
        return connect_cluster(nodes, password=self.group.password, **kwargs)

    def flush(self) -> None:
        """Every key of every primary gone: a clean cluster for the next test."""
        for node in self.group.nodes:
            with self.group.client(node) as c:
                c.flushall()
