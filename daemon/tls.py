"""How a TLS certificate is named between the server, poolctl and the people who compare them."""

from __future__ import annotations

import hashlib


def fingerprint(der: bytes) -> str:
    """`SHA256:` and the hex SHA-256 of the certificate's DER bytes (what `openssl x509
    -fingerprint -sha256` shows, without the colons)."""
    return "SHA256:" + hashlib.sha256(der).hexdigest()
