"""What a group of redis-server processes on loopback shares (a Sentinel group, a Cluster): each
process from its own config file and directory, the same binary as the embedded pool, a password,
bounded waits that show the processes' logs when they run out, and a stop that leaves nothing.
`with Group(...) as group:` starts it, and stops whatever was started if starting fails."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import redis as redis_sync

from daemon.queue.embedded_redis import find_binary


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


class RedisGroup:
    """The base of a group: subclasses list their processes (`processes`) and start them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.binary = find_binary()
        self.password = secrets.token_urlsafe(16)

    def processes(self) -> list[Process]:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        for p in self.processes():
            self.end(p, signal.SIGTERM)

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def node_conf(self, p: Process) -> list[str]:
        """What every data node of a group is: on loopback, its own directory and log, an AOF that
        loses nothing, the group's password (for replication too), and no eviction."""
        return [
            f"port {p.port}",
            "bind 127.0.0.1",
            f"dir {p.dir}",
            f"logfile {p.dir / 'log'}",
            "appendonly yes",
            "appendfsync always",
            'save ""',
            f"requirepass {self.password}",
            f"masterauth {self.password}",
            "maxmemory-policy noeviction",
        ]

    def launch(self, p: Process, conf: list[str], extra: Sequence[str] = ()) -> None:
        """`p` started from `conf` (written, mode 0600, into its directory), with `extra` arguments."""
        p.dir.mkdir(parents=True, exist_ok=True)
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

    def end(self, p: Process, sig: signal.Signals) -> None:
        """`sig` to `p` and wait (SIGKILL after 10 s): SIGKILL is a machine's death."""
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

    def client(self, p: Process, password: str | None = None) -> redis_sync.Redis:
        return redis_sync.Redis(
            host="127.0.0.1",
            port=p.port,
            password=password or self.password,
            socket_timeout=0.5,
            socket_connect_timeout=0.5,
        )

    def ping(self, p: Process, password: str | None = None) -> bool:
        if p.proc is not None and p.proc.poll() is not None:
            raise RuntimeError(f"redis-server on port {p.port} exited at start: {p.log_tail()}")
        try:
            with self.client(p, password) as c:
                return bool(c.ping())
        except (redis_sync.ConnectionError, redis_sync.TimeoutError, redis_sync.BusyLoadingError):
            return False

    def wait(self, condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                logs = "; ".join(f"{p.dir.name}: {p.log_tail(3)}" for p in self.processes())
                raise TimeoutError(f"waited {timeout:g} s for {what}; logs: {logs}")
            time.sleep(0.02)
