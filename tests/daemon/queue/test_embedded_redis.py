"""The embedded redis-server: secured, persistent, adopted after a crash, refused when too old."""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
import stat
from pathlib import Path

import pytest
import redis as redis_sync

from daemon.config import load
from daemon.queue.embedded_redis import EmbeddedRedis, EmbeddedRedisError, _is_redis_process, find_binary
from daemon.queue.pool_redis import embedded_max_memory


def test_starts_on_loopback_with_a_password_never_on_the_command_line(redis_server: EmbeddedRedis) -> None:
    assert redis_server.pid is not None
    with redis_sync.Redis(host="127.0.0.1", port=redis_server.port, password=redis_server.password) as r:
        assert r.ping()
        assert r.config_get("bind")["bind"] == "127.0.0.1"
        assert r.config_get("appendonly")["appendonly"] == "yes"
        assert r.config_get("appendfsync")["appendfsync"] == "always"
    with (
        redis_sync.Redis(host="127.0.0.1", port=redis_server.port) as anonymous,
        pytest.raises(redis_sync.AuthenticationError),
    ):
        anonymous.ping()
    cmdline = Path(f"/proc/{redis_server.pid}/cmdline").read_bytes()
    assert redis_server.password.encode() not in cmdline
    for name in ("password", "redis.conf"):
        assert stat.S_IMODE((redis_server.dir / name).stat().st_mode) == 0o600


def test_a_restarted_owner_adopts_the_running_server(tmp_path: Path) -> None:
    first = EmbeddedRedis(tmp_path)
    first.start()
    try:
        with redis_sync.Redis(port=first.port, password=first.password) as r:
            r.set("kept", "1")
        # the owner crashed without stopping Redis; a new owner on the same directory adopts it
        second = EmbeddedRedis(tmp_path)
        second.start()
        assert (second.adopted, second.pid, second.port) == (True, first.pid, first.port)
        with redis_sync.Redis(port=second.port, password=second.password) as r:
            assert r.get("kept") == b"1"
        pid = second.pid
        assert pid is not None
        second.stop()
        assert not _is_redis_process(pid)
        second.stop()  # twice is harmless
    finally:
        first.kill()


def test_restart_after_kill_keeps_data_and_port(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path, appendfsync="always")
    server.start()
    port = server.port
    with redis_sync.Redis(port=port, password=server.password) as r:
        r.rpush("list", *range(100))
    server.kill()
    fresh = EmbeddedRedis(tmp_path, appendfsync="always")
    fresh.start()
    try:
        assert not fresh.adopted
        assert fresh.port == port
        with redis_sync.Redis(port=fresh.port, password=fresh.password) as r:
            assert r.llen("list") == 100
    finally:
        fresh.stop()


def test_refuses_redis_older_than_6_2(tmp_path: Path) -> None:
    old = tmp_path / "redis-server"
    old.write_text("#!/bin/sh\necho 'Redis server v=5.0.7 sha=00000000:0 malloc=libc bits=64'\n")
    old.chmod(0o755)
    with pytest.raises(EmbeddedRedisError, match=r"Redis 5\.0\.7; gpupool needs Redis >= 6\.2"):
        EmbeddedRedis(tmp_path / "data", binary=old).start()


def test_the_shipped_binary_is_found() -> None:
    binary = find_binary()
    assert os.access(binary, os.X_OK)


async def test_its_clients_on_this_machine_go_through_a_socket_no_other_user_can_open(
    redis_server: EmbeddedRedis,
) -> None:
    """poold reaches its embedded Redis through a Unix socket in the 0700 directory: no TCP stack
    on the way, and a job running as another uid cannot even connect to try the password."""
    socket_path = redis_server.socket
    assert socket_path is not None
    assert socket_path.is_socket()
    client = redis_server.client()
    try:
        assert await client.ping()
        info = await client.client_info()
        # In through the socket: its path (Redis cuts a long one short), not HOST:PORT.
        laddr = str(info["laddr"])
        assert laddr.startswith("/"), laddr
        assert str(socket_path).startswith(laddr), (laddr, socket_path)
    finally:
        await client.aclose()
    if os.geteuid() != 0:
        pytest.skip("switching to another uid needs root")
    assert _connect_as(61013, socket_path) == errno.EACCES


def _connect_as(uid: int, path: Path) -> int:
    """What a process of `uid` gets when it connects to the Unix socket at `path`: 0, or the errno."""
    pid = os.fork()
    if pid == 0:  # the child: nothing but system calls, then out
        code = 0
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            socket.socket(socket.AF_UNIX).connect(str(path))
        except OSError as exc:
            code = exc.errno or 255
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_data_directory_too_deep_for_a_socket_is_served_over_tcp(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    server = EmbeddedRedis(deep)
    assert server.socket is None
    server.start()
    try:
        with redis_sync.Redis(port=server.port, password=server.password) as r:
            assert r.ping()
        assert not list(server.dir.glob("*.sock"))
    finally:
        server.stop()


def test_the_embedded_redis_has_a_memory_limit_also_when_adopted(tmp_path: Path) -> None:
    """issue 44 item 6: the embedded Redis had no maxmemory, so one user could fill the machine.
    It has one (noeviction), by default a quarter of the machine's memory, `redis_max_memory`
    when set, and a redis-server adopted from a poold before takes the one configured now."""
    default = load(None, env={"GPUPOOL_DATA_DIR": str(tmp_path)}, config_file=None)
    assert embedded_max_memory(default) == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    chosen = dataclasses.replace(default, redis_max_memory=64 * 2**20)
    first = EmbeddedRedis(tmp_path, max_memory=embedded_max_memory(chosen))
    first.start()
    try:
        with redis_sync.Redis(port=first.port, password=first.password) as r:
            limits = r.config_get("maxmemory*")
        assert (limits["maxmemory"], limits["maxmemory-policy"]) == (str(64 * 2**20), "noeviction")
        again = EmbeddedRedis(tmp_path, max_memory=32 * 2**20)
        again.start()
        assert again.adopted
        with redis_sync.Redis(port=again.port, password=again.password) as r:
            assert r.config_get("maxmemory")["maxmemory"] == str(32 * 2**20)
    finally:
        first.kill()


def test_maxmemory_is_never_set_below_what_redis_already_holds(tmp_path: Path) -> None:
    """issue 44 item 6: an embedded Redis that already held more than its new maxmemory (a pool
    upgraded to the default limit, data over a quarter of RAM) was given that limit as it was, so
    every script that adds (leases' renewals, outcomes) was refused at once. It gets no less
    than 1.1 times what it holds, adopted or restarted from its AOF, and a warning says so."""
    first = EmbeddedRedis(tmp_path)
    first.start()
    try:
        with redis_sync.Redis(port=first.port, password=first.password) as r:
            r.set("filler", b"x" * 8 * 2**20)
        adopted = EmbeddedRedis(tmp_path, max_memory=2**20)
        adopted.start()
        assert adopted.adopted
        with redis_sync.Redis(port=adopted.port, password=adopted.password) as r:
            assert int(r.config_get("maxmemory")["maxmemory"]) > 1.1 * 8 * 2**20  # (the filler alone)
            r.set("a lease renewed", "1")  # a write that adds still goes through
        adopted.stop()
        restarted = EmbeddedRedis(tmp_path, max_memory=2**20)
        restarted.start()
        assert not restarted.adopted
        with redis_sync.Redis(port=restarted.port, password=restarted.password) as r:
            assert len(r.get("filler") or b"") == 8 * 2**20
            assert int(r.config_get("maxmemory")["maxmemory"]) > 1.1 * 8 * 2**20
            r.set("a lease renewed", "1")
        restarted.stop()
    finally:
        first.kill()
