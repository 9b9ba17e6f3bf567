"""A Redis Cluster on loopback, from the same redis-server binary as the embedded pool: `primaries`
nodes with `cluster-enabled yes`, introduced to each other (CLUSTER MEET) and given the 16 384
slots in equal ranges (CLUSTER ADDSLOTS): what redis-cli --cluster create does, without redis-cli.
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import subprocess
import time
from pathlib import Path

import redis as redis_sync

from daemon.queue.embedded_redis import find_binary, free_port, port_free
from tests.support.sentinel import Process

SLOTS = 16384
BUS_OFFSET = 10000  # a node's cluster bus listens on its port + 10 000 (Redis 6.2 has no cluster-port)


def bus_free_port() -> int:
    """A free port whose cluster bus port is free too (and below 65 536)."""
    for _ in range(1000):
        port = free_port()
        if port + BUS_OFFSET < 65536 and port_free(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class ClusterGroup:
    """`with ClusterGroup(root) as cluster:` a running cluster, its state ok on every node."""

    def __init__(self, root: Path, primaries: int = 3) -> None:
        self.root = root
        self.binary = find_binary()
        self.password = secrets.token_urlsafe(16)
        self.nodes = [Process(bus_free_port(), root / f"node{i}") for i in range(primaries)]

    def __enter__(self) -> ClusterGroup:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> None:
        for node in self.nodes:
            node.dir.mkdir(parents=True, exist_ok=True)
            conf = node.dir / "redis.conf"
            conf.write_text(
                "\n".join(
                    [
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
                )
                + "\n"
            )
            node.proc = subprocess.Popen(
                [self.binary, str(conf)],
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        for node in self.nodes:
            self._wait(lambda n=node: self._ping(n), f"node on port {node.port}")
        first, share = self.nodes[0], SLOTS // len(self.nodes)
        for i, node in enumerate(self.nodes):
            with self.client(node) as c:
                if node is not first:
                    c.execute_command("CLUSTER MEET", "127.0.0.1", first.port)
                upto = SLOTS if i == len(self.nodes) - 1 else (i + 1) * share
                c.execute_command("CLUSTER ADDSLOTS", *range(i * share, upto))
        self._wait(self._ok, "the cluster's state to be ok on every node")

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                node.proc.send_signal(signal.SIGTERM)
            try:
                node.proc.wait(10)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait(5)
            node.proc = None

    def client(self, node: Process) -> redis_sync.Redis:
        return redis_sync.Redis(
            host="127.0.0.1",
            port=node.port,
            password=self.password,
            socket_timeout=2,
            socket_connect_timeout=1,
        )

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

    def _ping(self, node: Process) -> bool:
        if node.proc is not None and node.proc.poll() is not None:
            raise RuntimeError(f"redis-server on port {node.port} exited at start: {node.log_tail()}")
        try:
            with self.client(node) as c:
                return bool(c.ping())
        except redis_sync.ConnectionError:
            return False

    def _ok(self) -> bool:
        for node in self.nodes:
            with self.client(node) as c:
                info = c.execute_command("CLUSTER INFO")  # parsed by redis-py into a dict
                if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) != len(
                    self.nodes
                ):
                    return False
        return True

    def _wait(self, condition: object, what: str, timeout: float = 30.0) -> None:
        assert callable(condition)
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                logs = "; ".join(f"{n.dir.name}: {n.log_tail(3)}" for n in self.nodes)
                raise TimeoutError(f"waited {timeout:g} s for {what}; logs: {logs}")
            time.sleep(0.05)
