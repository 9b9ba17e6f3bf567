"""The servers poolctl has met: each address's certificate fingerprint, pinned on first use.

Like ssh's known_hosts: the first TLS connection to a server whose certificate no CA vouches for
(the one it made itself, daemon/server/certificate.py) records its fingerprint in
`~/.config/gpupool/known_servers` and says so on stderr, for the user to compare with what the
server logged at start; every later connection must present the same certificate, or poolctl
refuses to send anything, since someone may be in the middle.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from daemon.errors import GpupoolError
from daemon.tls import fingerprint
from daemon.tokens import client_dir


class CertificateChanged(GpupoolError):
    """The server at an address presented another certificate than the one pinned for it."""


def known_servers_file() -> Path:
    return client_dir() / "known_servers"


def _read(path: Path) -> dict[str, str]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return {}
    return dict(line.split(maxsplit=1) for line in lines if line.strip() and not line.startswith("#"))


def check_configured(address: str, der: bytes, pin: str) -> None:
    """The certificate `der` must be the one pools.toml pins for the pool at `address`."""
    seen = fingerprint(der)
    if seen.lower() != pin.lower():
        raise CertificateChanged(
            f"the server at {address} presented the certificate {seen}, not the {pin} that pools.toml "
            "pins for it (tls_pin): someone may be between you and the pool, so nothing was sent. If its "
            "certificate was replaced on purpose, put the new fingerprint poold logged at start in tls_pin"
        )


def check(address: str, der: bytes) -> None:
    """Pin `address`'s certificate `der` if it is new here; CertificateChanged if it differs."""
    path = known_servers_file()
    seen = fingerprint(der)
    pinned = _read(path).get(address)
    if pinned == seen:
        return
    if pinned is not None:
        raise CertificateChanged(
            f"the server at {address} presented the certificate {seen}, not the {pinned} pinned for it in "
            f"{path}: someone may be between you and the pool, so nothing was sent. If its certificate was "
            "replaced on purpose (ask the pool's admin for the fingerprint poold logs at start), remove its "
            "line from that file"
        )
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write(f"{address} {seen}\n")
    print(
        f"poolctl: first TLS connection to {address}: pinned its certificate {seen} in {path} "
        "(compare it with the fingerprint poold logged at start)",
        file=sys.stderr,
    )
