"""A Redis Sentinel group on loopback, from the same redis-server binary as the embedded pool: a
primary, its replicas and three sentinels, each a process of its own, so that a test can kill the
primary for real (SIGKILL) and watch the sentinels promote a replica.

The nodes share one password (`requirepass`, and `masterauth` for the replicas); the sentinels
have their own (`requirepass`, and `sentinel-pass` to speak to each other), as a deployment that
follows docs/OPERATIONS.md has. Sentinel rewrites its configuration file as it learns the group:
each sentinel has its own directory.
"""

from __future__ import annotations

import functools
import secrets
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import redis as redis_sync

from daemon.queue.embedded_redis import free_port
from tests.support.redis_group import Process, RedisGroup

MASTER = "gpupool"  # the group's name, as sentinels know it (redis_sentinel_master)


class SentinelGroup(RedisGroup):
    """`start()`: the primary, `replicas` replicas in sync with it, three sentinels agreeing on
    them (quorum 2); `stop()` ends every process left. A primary unreachable for `down_after_ms`
    is failed over."""

    def __init__(self, root: Path, *, replicas: int = 1, down_after_ms: int = 500) -> None:
        super().__init__(root)
        self.sentinel_password = secrets.token_urlsafe(16)
        self.down_after_ms = down_after_ms
        self.nodes = [Process(free_port(), root / f"node{i}") for i in range(1 + replicas)]
        self.sentinels = [Process(free_port(), root / f"sentinel{i}") for i in range(3)]

    @property
    def sentinel_addresses(self) -> list[str]:
        return [s.address for s in self.sentinels]

    # -- life cycle --------------------------------------------------------------------------------

    def start(self) -> None:
        primary = self.nodes[0]
        for i, node in enumerate(self.nodes):
            self._start_node(node, None if i == 0 else primary.port)
        for node in self.nodes[1:]:
            self.wait(functools.partial(self._in_sync, node), f"the replica on port {node.port} to sync")
        for sentinel in self.sentinels:
            self._start_sentinel(sentinel, primary.port)
        others, replicas = len(self.sentinels) - 1, len(self.nodes) - 1

        def agreed() -> bool:
            for s in self.sentinels:
                with self._sentinel(s) as c:
                    state: dict[str, int] = c.sentinel_master(MASTER)
                if state["num-other-sentinels"] < others or state["num-slaves"] < replicas:
                    return False
            return True

        self.wait(agreed, "the sentinels to find each other and the replicas")

    # -- faults ------------------------------------------------------------------------------------

    def primary(self) -> Process:
        """The node the sentinels name as the primary now."""
        _, port = self._ask_sentinels()
        return next(n for n in self.nodes if n.port == int(port))

    def kill(self, node: Process) -> None:
        """SIGKILL, as a machine's death: no AOF flush, no goodbye to the replicas."""
        self.end(node, signal.SIGKILL)

    def restart(self, node: Process) -> None:
        """Start a killed node again on its own AOF, as a rebooted machine: the sentinels make it a
        replica of whichever node is the primary now (what only it had is dropped when it syncs)."""
        assert node.proc is None, "the node still runs"
        self.launch(node, (node.dir / "redis.conf").read_text().splitlines(), [])
        self.wait(lambda: self.ping(node), f"node on port {node.port} to come back")

    def wait_failover(self, old: Process, timeout: float = 30.0) -> Process:
        """The replica the sentinels promoted in `old`'s place, once every sentinel that answers
        (at least a quorum) names it, up (as a client asks them), and it answers as a primary."""

        def promoted() -> bool:
            ports, answered = set(), 0
            for state in self._answers(lambda c: c.sentinel_master(MASTER)):
                if not state["is_master"] or state["is_sdown"] or state["is_odown"]:
                    return False
                ports.add(int(state["port"]))
                answered += 1
            if answered < 2 or len(ports) != 1 or old.port in ports:
                return False
            node = next(n for n in self.nodes if n.port in ports)
            return self._info(node, "replication").get("role") == "master"

        self.wait(promoted, "a failover", timeout)
        return self.primary()

    # -- parts -------------------------------------------------------------------------------------

    def _start_node(self, node: Process, primary_port: int | None) -> None:
        conf = [
            *self.node_conf(node),
            "repl-diskless-sync yes",
            "repl-diskless-sync-delay 0",
        ]
        if primary_port is not None:
            conf.append(f"replicaof 127.0.0.1 {primary_port}")
        self.launch(node, conf)
        self.wait(lambda: self.ping(node), f"node on port {node.port}")

    def _start_sentinel(self, sentinel: Process, primary_port: int) -> None:
        conf = [
            f"port {sentinel.port}",
            "bind 127.0.0.1",
            f"dir {sentinel.dir}",
            f"logfile {sentinel.dir / 'log'}",
            f"requirepass {self.sentinel_password}",
            f"sentinel sentinel-pass {self.sentinel_password}",
            f"sentinel monitor {MASTER} 127.0.0.1 {primary_port} 2",
            f"sentinel auth-pass {MASTER} {self.password}",
            f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}",
            f"sentinel failover-timeout {MASTER} 5000",
            f"sentinel parallel-syncs {MASTER} 1",
        ]
        self.launch(sentinel, conf, ["--sentinel"])
        self.wait(lambda: self.ping(sentinel, self.sentinel_password), f"sentinel on port {sentinel.port}")

    def _sentinel(self, p: Process) -> redis_sync.Redis:
        return self.client(p, self.sentinel_password)

    def processes(self) -> list[Process]:
        return [*self.sentinels, *self.nodes]

    def _in_sync(self, node: Process) -> bool:
        return self._info(node, "replication").get("master_link_status") == "up"

    def _info(self, node: Process, section: str) -> dict[str, object]:
        try:
            with self.client(node, self.password) as c:
                info: dict[str, object] = c.info(section)
                return info
        except redis_sync.RedisError:
            return {}

    def _ask_sentinels(self) -> tuple[str, str]:
        """The primary's address as the first sentinel that answers gives it."""
        for got in self._answers(lambda c: c.sentinel_get_master_addr_by_name(MASTER)):
            if got:
                host, port = got
                return str(host), str(port)
        raise RuntimeError("no sentinel answers")

    def _answers(self, ask: Callable[[redis_sync.Redis], Any]) -> Iterator[Any]:
        """Each running sentinel's answer to `ask`, those that do not answer (stopped, say) left out."""
        for s in self.sentinels:
            if s.proc is None:
                continue
            try:
                with self._sentinel(s) as c:
                    answer = ask(c)
            except redis_sync.RedisError:
                continue
            yield answer
