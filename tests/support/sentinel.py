"""A Redis Sentinel group on loopback, from the same redis-server binary as the embedded pool: a
primary, its replicas and three sentinels, each a process of its own, so that a test can kill the
primary for real (SIGKILL) and watch the sentinels promote a replica.

The nodes share one password (`requirepass`, and `masterauth` for the replicas); the sentinels
have their own (`requirepass`, and `sentinel-pass` to speak to each other), as a deployment that
follows docs/OPERATIONS.md has. Sentinel rewrites its configuration file as it learns the group:
each sentinel has its own directory.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis as redis_sync

from daemon.queue.embedded_redis import find_binary, free_port

MASTER = "gpupool"  # the group's name, as sentinels know it (redis_sentinel_master)


@dataclass
class Process:
    port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join((self.dir / "log").read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"


class SentinelGroup:
    """`start()`: the primary, `replicas` replicas in sync with it, three sentinels agreeing on
    them (quorum 2); `stop()` ends every process left. A primary unreachable for `down_after_ms`
    is failed over."""

    def __init__(self, root: Path, *, replicas: int = 1, down_after_ms: int = 500) -> None:
        self.root = root
        self.binary = find_binary()
        self.password = secrets.token_urlsafe(16)
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
            self._wait(lambda n=node: self._info(n, "replication").get("master_link_status") == "up", "sync")
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

        self._wait(agreed, "the sentinels to find each other and the replicas")

    def stop(self) -> None:
        for p in [*self.sentinels, *self.nodes]:
            self._end(p, signal.SIGTERM)

    def __enter__(self) -> SentinelGroup:
        """Started (and stopped again, whatever was started, if starting fails)."""
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    # -- faults ------------------------------------------------------------------------------------

    def primary(self) -> Process:
        """The node the sentinels name as the primary now."""
        _, port = self._ask_sentinels()
        return next(n for n in self.nodes if n.port == int(port))

    def kill(self, node: Process) -> None:
        """SIGKILL, as a machine's death: no AOF flush, no goodbye to the replicas."""
        self._end(node, signal.SIGKILL)

    def restart(self, node: Process) -> None:
        """Start a killed node again on its own AOF, as a rebooted machine: the sentinels make it a
        replica of whichever node is the primary now (what only it had is dropped when it syncs)."""
        assert node.proc is None, "the node still runs"
        self._launch(node, (node.dir / "redis.conf").read_text().splitlines(), [])
        self._wait(lambda: self._ping(node), f"node on port {node.port} to come back")

    def wait_failover(self, old: Process, timeout: float = 30.0) -> Process:
        """The replica the sentinels promoted in `old`'s place, once every sentinel that answers
        (at least a quorum) names it, up (as a client asks them), and it answers as a primary."""

        def promoted() -> bool:
            ports, answered = set(), 0
            for s in self.sentinels:
                if s.proc is None:
                    continue
                try:
                    with self._sentinel(s) as c:
                        state = c.sentinel_master(MASTER)
                except redis_sync.RedisError:
                    continue  # stopped, say
                if not state["is_master"] or state["is_sdown"] or state["is_odown"]:
                    return False
                ports.add(int(state["port"]))
                answered += 1
            if answered < 2 or len(ports) != 1 or old.port in ports:
                return False
            node = next(n for n in self.nodes if n.port in ports)
            return self._info(node, "replication").get("role") == "master"

        self._wait(promoted, "a failover", timeout)
        return self.primary()

    # -- parts -------------------------------------------------------------------------------------

    def _start_node(self, node: Process, primary_port: int | None) -> None:
        node.dir.mkdir(parents=True, exist_ok=True)
        conf = [
            f"port {node.port}",
            "bind 127.0.0.1",
            f"dir {node.dir}",
            f"logfile {node.dir / 'log'}",
            "appendonly yes",
            "appendfsync always",
            'save ""',
            f"requirepass {self.password}",
            f"masterauth {self.password}",
            "maxmemory-policy noeviction",
            "repl-diskless-sync yes",
            "repl-diskless-sync-delay 0",
        ]
        if primary_port is not None:
            conf.append(f"replicaof 127.0.0.1 {primary_port}")
        self._launch(node, conf, [])
        self._wait(lambda: self._ping(node), f"node on port {node.port}")

    def _start_sentinel(self, sentinel: Process, primary_port: int) -> None:
        sentinel.dir.mkdir(parents=True, exist_ok=True)
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
        self._launch(sentinel, conf, ["--sentinel"])
        self._wait(lambda: self._ping(sentinel, self.sentinel_password), f"sentinel on port {sentinel.port}")

    def _launch(self, p: Process, conf: list[str], extra: list[str]) -> None:
        path = p.dir / "redis.conf"
        path.write_text("\n".join(conf) + "\n")
        os.chmod(path, 0o600)
        p.proc = subprocess.Popen(
            [self.binary, str(path), *extra],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def _end(self, p: Process, sig: signal.Signals) -> None:
        if p.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            p.proc.send_signal(sig)
        try:
            p.proc.wait(10)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait(5)
        p.proc = None

    def _client(self, p: Process, password: str) -> redis_sync.Redis:
        return redis_sync.Redis(
            host="127.0.0.1", port=p.port, password=password, socket_timeout=0.5, socket_connect_timeout=0.5
        )

    def _sentinel(self, p: Process) -> redis_sync.Redis:
        return self._client(p, self.sentinel_password)

    def _ping(self, p: Process, password: str | None = None) -> bool:
        if p.proc is not None and p.proc.poll() is not None:
            raise RuntimeError(f"redis-server on port {p.port} exited at start: {p.log_tail()}")
        try:
            with self._client(p, password or self.password) as c:
                return bool(c.ping())
        except (redis_sync.ConnectionError, redis_sync.BusyLoadingError):
            return False

    def _info(self, node: Process, section: str) -> dict[str, object]:
        try:
            with self._client(node, self.password) as c:
                info: dict[str, object] = c.info(section)
                return info
        except redis_sync.RedisError:
            return {}

    def _ask_sentinels(self) -> tuple[str, str]:
        """The primary's address as the first sentinel that answers gives it."""
        for s in self.sentinels:
            if s.proc is None:
                continue
            try:
                with self._sentinel(s) as c:
                    got = c.sentinel_get_master_addr_by_name(MASTER)
            except redis_sync.RedisError:
                continue
            if got:
                host, port = got
                return str(host), str(port)
        raise RuntimeError("no sentinel answers")

    def _wait(self, condition: object, what: str, timeout: float = 30.0) -> None:
        assert callable(condition)
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                logs = "; ".join(f"{p.dir.name}: {p.log_tail(3)}" for p in [*self.nodes, *self.sentinels])
                raise TimeoutError(f"waited {timeout:g} s for {what}; logs: {logs}")
            time.sleep(0.02)
