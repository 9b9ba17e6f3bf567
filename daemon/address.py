"""HOST:PORT, parsed in one place: the server's listen address, metrics ports, poolctl's --server
(which may also name a local server's Unix socket, unix:PATH); and whether a host is this
machine's loopback (what may go without authentication or TLS)."""

from __future__ import annotations

import ipaddress
import os

SERVER_PORT = 7420  # the wire protocol's port, where no address names one

EXAMPLE = "expected HOST:PORT, e.g. 127.0.0.1:7420 or [::1]:7420"


def parse_host_port(text: str, *, default_host: str | None = None) -> tuple[str, int]:
    """`text` as (host, port); an IPv6 host may be bracketed. With `default_host`, ":PORT" is allowed
    and means that host. Raises ValueError saying what was expected."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") or (default_host or "")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(EXAMPLE)
    return host, int(port)


def parse_host_ports(texts: list[str]) -> list[tuple[str, int]]:
    """Each of `texts` as (host, port) (a list option's addresses); ValueError naming the bad one."""
    out = []
    for text in texts:
        try:
            out.append(parse_host_port(text))
        except ValueError as exc:
            raise ValueError(f"{text!r}: {exc}") from None
    return out


UNIX = "unix:"  # an address "unix:PATH": a Unix socket on this machine (a local server's)


UNIX_PATH_MAX = 108  # bytes of a Unix socket's path, its terminating NUL included (Linux)


def fits_unix_socket(path: os.PathLike[str] | str) -> bool:
    """Whether a Unix socket can be made at `path` (its path is short enough)."""
    return len(os.fsencode(path)) < UNIX_PATH_MAX


def unix_path(address: str) -> str | None:
    """The socket's path when `address` names a Unix socket ("unix:PATH"), else None."""
    return address[len(UNIX) :] if address.startswith(UNIX) else None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_host_names(names: list[str]) -> list[str]:
    """Host names as a Host header carries them, without a port (an IPv6 address bare); ValueError
    naming the first that is not one."""
    for name in names:
        if ":" in name:
            try:
                ipaddress.IPv6Address(name.strip("[]"))
            except ValueError:
                bare = name.rpartition(":")[0]
                raise ValueError(f"{name!r}: a name without its port (web_listen's), e.g. {bare!r}") from None
        if not name or any(c.isspace() or c in "/@" for c in name):
            raise ValueError(f"{name!r} is not a host name")
    return names
