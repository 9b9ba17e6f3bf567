"""A Redis Cluster on loopback, from the same redis-server binary as the embedded pool: `primaries`
nodes with `cluster-enabled yes`, introduced to each other (CLUSTER MEET) and given the 16 384
slots in equal ranges (CLUSTER ADDSLOTS): what redis-cli --cluster create does, without redis-cli.
"""

from __future__ import annotations

import functools
import signal
from pathlib import Path
from typing import Any

import redis as redis_sync
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
    """`with ClusterGroup(root) as cluster:` a running cluster, its state ok on every node:
    `primaries` nodes sharing the slots, and `replicas` replicas of each (CLUSTER REPLICATE), which
    take over their primary's slots when it dies (cluster-node-timeout 1 s)."""

    def __init__(self, root: Path, primaries: int = 3, replicas: int = 0) -> None:
        super().__init__(root)
        self.nodes = [Process(bus_free_port(), root / f"node{i}") for i in range(primaries)]
        self.replicas = [
            Process(bus_free_port(), root / f"replica{i}-{j}")
            for i in range(primaries)
            for j in range(replicas)
        ]

    def processes(self) -> list[Process]:
        return self.nodes + self.replicas

    def _answering(self, node: Process, tries: int = 5) -> None:
        """Wait for `node` to answer. Its port and bus port were free when picked, not held: when
        another process took one before the node bound it (an outgoing connection's port, say),
        the node exits at start, and starts again on ports picked afresh."""
        for attempt in range(tries):
            try:
                self.wait(functools.partial(self.ping, node), f"node on port {node.port}")
                return
            except RuntimeError as exc:
                if "Address already in use" not in str(exc) or attempt == tries - 1:
                    raise
            node.port = bus_free_port()
            (node.dir / "nodes.conf").unlink(missing_ok=True)
            self.launch(node, self._conf(node))

    def _conf(self, node: Process) -> list[str]:
        return [
            *self.node_conf(node),
            "cluster-enabled yes",
            "cluster-config-file nodes.conf",
            "cluster-node-timeout 1000",
        ]

    def start(self) -> None:
        for node in self.processes():
            self.launch(node, self._conf(node))
        for node in self.processes():
            self._answering(node)
        first, share = self.nodes[0], SLOTS // len(self.nodes)
        for i, node in enumerate(self.nodes):
            with self.client(node) as c:
                if node is not first:
                    c.execute_command("CLUSTER MEET", "127.0.0.1", first.port)
                upto = SLOTS if i == len(self.nodes) - 1 else (i + 1) * share
                c.execute_command("CLUSTER ADDSLOTS", *range(i * share, upto))
        for replica in self.replicas:
            with self.client(replica) as c:
                c.execute_command("CLUSTER MEET", "127.0.0.1", first.port)
        self.wait(self._all_known, "every node to know every other")
        per_primary = len(self.replicas) // len(self.nodes)
        for i, replica in enumerate(self.replicas):
            with self.client(self.nodes[i // per_primary]) as c:
                primary_id = c.execute_command("CLUSTER MYID")
            with self.client(replica) as c:
                c.execute_command("CLUSTER REPLICATE", primary_id)
        self.wait(self._ok, "the cluster's state to be ok on every node, every replica in sync")

    def kill(self, node: Process) -> None:
        """SIGKILL: a machine's death; its replica takes over once the others agree it failed."""
        self.end(node, signal.SIGKILL)

    def restart(self, node: Process) -> None:
        """Start a killed node again on its directory: it rejoins as a replica of whoever took
        over its slots; returns once it is in sync."""
        self.launch(node, self._conf(node))
        self.wait(functools.partial(self.ping, node), f"node on port {node.port} to come back")
        self.wait(self._ok, f"node on port {node.port} to rejoin, in sync")

    def replicas_of(self, port: int) -> list[Process]:
        """The running replicas of the primary on `port`."""
        out = []
        for node in self.running():
            with self.client(node) as c:
                info = c.info("replication")
            if info.get("role") == "slave" and int(info.get("master_port", 0)) == port:
                out.append(node)
        return out

    def running(self) -> list[Process]:
        return [p for p in self.processes() if p.proc is not None]

    def owner(self, slot: int) -> int:
        """The port of the node that serves `slot`, as a running node says."""
        with self.client(self.running()[0]) as c:
            for start, end, primary, *_ in c.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return int(primary[1])
        raise LookupError(f"no node serves slot {slot}")

    def wait_failover(self, slot: int, dead: int, timeout: float = 30.0) -> int:
        """Wait until a node other than port `dead` serves `slot` and the cluster is ok on every
        running node; that node's port."""

        def moved() -> bool:
            try:
                return self.owner(slot) != dead and self._ok()
            except (redis_sync.RedisError, LookupError):
                return False

        self.wait(moved, f"slot {slot} to fail over from port {dead}", timeout)
        return self.owner(slot)

    def keyslot(self, key: str) -> int:
        with self.client(self.nodes[0]) as c:
            return int(c.execute_command("CLUSTER KEYSLOT", key))

    def _all_known(self) -> bool:
        return all(
            self._info(node).get("cluster_known_nodes") == len(self.processes()) for node in self.running()
        )

    def _ok(self) -> bool:
        """The state is ok on every running node, and every replica is in sync with its primary."""
        primaries = self.primaries()
        for node in self.running():
            if self._info(node).get("cluster_state") != "ok":
                return False
            if node.port not in primaries:
                with self.client(node) as c:
                    if c.info("replication").get("master_link_status") != "up":
                        return False
        return True

    def primaries(self) -> set[int]:
        """The ports of the nodes that serve slots now."""
        with self.client(self.running()[0]) as c:
            return {int(primary[1]) for _, _, primary, *_ in c.execute_command("CLUSTER SLOTS")}

    def _info(self, node: Process) -> dict[str, Any]:
        with self.client(node) as c:
            info: dict[str, Any] = c.execute_command("CLUSTER INFO")  # parsed by redis-py into a dict
            return {k: int(v) if str(v).isdigit() else v for k, v in info.items()}


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
        primaries = self.group.primaries()
        for node in self.group.running():
            if node.port in primaries:
                with self.group.client(node) as c:
                    c.flushall()
