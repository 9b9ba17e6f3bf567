"""The systemd notify protocol, against a datagram socket the test owns (no systemd needed)."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon import sd_notify


@pytest.fixture
def notify_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A bound AF_UNIX datagram socket named by NOTIFY_SOCKET. A short directory of its own, since
    a socket path must fit in 108 bytes and pytest's tmp_path may not."""
    with tempfile.TemporaryDirectory(prefix="gpn-") as tmp:
        path = Path(tmp) / "notify"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(str(path))
            sock.settimeout(2)
            monkeypatch.setenv("NOTIFY_SOCKET", str(path))
            monkeypatch.delenv("WATCHDOG_USEC", raising=False)
            monkeypatch.delenv("WATCHDOG_PID", raising=False)
            yield sock


def received(sock: socket.socket) -> list[str]:
    """The datagrams waiting in `sock` now, without waiting for more."""
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except BlockingIOError:
        return out
    finally:
        sock.settimeout(2)


def test_ready_status_stopping(notify_socket: socket.socket) -> None:
    assert sd_notify.ready("serving on 127.0.0.1:7420")
    assert notify_socket.recv(4096) == b"READY=1\nSTATUS=serving on 127.0.0.1:7420"
    assert sd_notify.status("2 jobs running\nline two")  # a newline would start a new assignment
    assert notify_socket.recv(4096) == b"STATUS=2 jobs running line two"
    assert sd_notify.stopping()
    assert notify_socket.recv(4096) == b"STOPPING=1"
    assert received(notify_socket) == []


def test_abstract_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"gpupool-test-{secrets.token_hex(8)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sd_notify.ready()
        assert sock.recv(4096) == b"READY=1"


def test_no_socket_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not sd_notify.ready()
    assert not sd_notify.notify("WATCHDOG=1")


def test_unreachable_socket_is_logged_not_raised(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert not sd_notify.ready()
    assert "cannot notify systemd" in caplog.text


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    pid = str(os.getpid())
    assert sd_notify.watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert sd_notify.watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": pid}) == 15.0
    assert sd_notify.watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert sd_notify.watchdog_interval({}) is None
    assert sd_notify.watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert sd_notify.watchdog_interval({"WATCHDOG_USEC": "soon"}) is None


async def test_watchdog_is_fed_by_the_event_loop(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # 0.1 s: pings every 0.05 s
    interval = sd_notify.watchdog_interval()
    assert interval == 0.05
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(sd_notify.watchdog(interval))
    try:
        got = [await loop.run_in_executor(None, notify_socket.recv, 4096) for _ in range(3)]
        assert got == [b"WATCHDOG=1"] * 3
        received(notify_socket)
        # A blocked event loop stops feeding the watchdog: nothing arrives while it is stuck.
        time.sleep(0.3)
        assert received(notify_socket) == []
        await asyncio.sleep(0.2)  # and the pings resume once it runs again
        assert received(notify_socket)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
