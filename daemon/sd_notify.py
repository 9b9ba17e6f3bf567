"""The systemd notify protocol: READY=1, STATUS=..., WATCHDOG=1, STOPPING=1 to $NOTIFY_SOCKET.

The protocol is one datagram of ``KEY=value`` lines to an AF_UNIX/SOCK_DGRAM socket whose path
systemd puts in NOTIFY_SOCKET (a leading ``@`` names the abstract namespace). That is a few lines
of socket code, so it is written here rather than taken from a library: `systemd-python` is a C
extension that needs libsystemd headers to build, and the pure-Python `sdnotify` is these same
lines, unmaintained, without the abstract-namespace case or the watchdog interval. Without
NOTIFY_SOCKET (not started by systemd, or Type= is not notify) every call does nothing.

The watchdog (`watchdog`) is fed from the event loop itself: a loop blocked for longer than
WatchdogSec stops feeding it, and systemd kills and restarts the daemon, which is the point.

Jobs inherit the daemon's environment unless told otherwise; `NOTIFY_ENV` names the variables a
runner should drop so a job can never speak for the daemon (the units also set NotifyAccess=main).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)

NOTIFY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
SEND_TIMEOUT = 1.0  # seconds; a datagram to a live systemd never waits, a wedged one must not stall us


def _address(env: Mapping[str, str]) -> str | None:
    path = env.get("NOTIFY_SOCKET", "")
    if path.startswith("@"):
        return "\0" + path[1:]
    if path.startswith("/"):
        return path
    if path:  # e.g. vsock:CID:PORT, which systemd uses for VMs; not a place poold runs
        log.warning("NOTIFY_SOCKET=%r is not a unix socket path: not notifying systemd", path)
    return None


def notify(*assignments: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``KEY=value`` assignments in one datagram. True if sent, False when there is no
    NOTIFY_SOCKET or sending failed (logged: the daemon keeps running either way)."""
    address = _address(os.environ if env is None else env)
    if address is None:
        return False
    message = "\n".join(assignments).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(SEND_TIMEOUT)
            sock.connect(address)
            sock.sendall(message)
    except OSError as exc:
        log.warning("cannot notify systemd (%s): %s", ", ".join(assignments), exc)
        return False
    return True


def _one_line(text: str) -> str:
    return " ".join(text.split())  # a newline would start a new assignment


def ready(status: str = "") -> bool:
    """The daemon serves: listening, Redis reachable (and the bucket, for a worker)."""
    return notify("READY=1", *([f"STATUS={_one_line(status)}"] if status else []))


def status(text: str) -> bool:
    """A one-line summary `systemctl status` shows."""
    return notify(f"STATUS={_one_line(text)}")


def stopping(status: str = "") -> bool:
    """The daemon is shutting down (draining); systemd's TimeoutStopSec now runs."""
    return notify("STOPPING=1", *([f"STATUS={_one_line(status)}"] if status else []))


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings: half of WATCHDOG_USEC, as sd_watchdog_enabled(3) advises.
    None when the watchdog is off, or meant for another process (WATCHDOG_PID is not ours)."""
    env = os.environ if env is None else env
    usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    if not usec.isdigit() or int(usec) == 0:
        if usec:
            log.warning("WATCHDOG_USEC=%r is not a positive integer: not feeding the watchdog", usec)
        return None
    return int(usec) / 1e6 / 2


async def watchdog(interval: float) -> None:
    """Send WATCHDOG=1 every `interval` seconds until cancelled. Run it as a task on the daemon's
    own event loop (never a thread), so that a stalled loop starves it."""
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)
