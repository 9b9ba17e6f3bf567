"""HMAC-SHA256 challenge-response: mutual proof of a shared per-user token.

Both sides contribute a 32-byte random nonce, so a proof captured on one connection is useless on
the next (the server's nonce differs). The token itself never crosses the wire::

    client proof = HMAC-SHA256(token, b"gpupool-auth-v1\\x00client\\x00" + server_nonce + client_nonce + user)
    server proof = HMAC-SHA256(token, b"gpupool-auth-v1\\x00server\\x00" + server_nonce + client_nonce + user)

The nonces have a fixed length, so the concatenation is unambiguous; the role label keeps a
client proof from being reflected back as a server proof.
"""

import hashlib
import hmac
import os
from collections.abc import Mapping
from typing import Final

from protocol.errors import ErrorCode, RemoteProtocolError
from protocol.messages import NONCE_SIZE

__all__ = ["AUTH_CONTEXT", "Authenticator", "check_server_proof", "client_proof", "new_nonce", "server_proof"]

AUTH_CONTEXT: Final = b"gpupool-auth-v1\x00"

# One sentence for every failure, so a prober cannot tell an unknown user from a wrong token.
AUTH_FAILED_MESSAGE: Final = (
    "Authentication failed: the user is unknown or the token is wrong; check the token file poolctl uses."
)


def new_nonce() -> bytes:
    """A fresh random nonce from the OS CSPRNG (what secrets.token_bytes is, without importing
    `secrets` and `random` into every poolctl command)."""
    return os.urandom(NONCE_SIZE)


def _proof(role: bytes, token: bytes, server_nonce: bytes, client_nonce: bytes, user: str) -> bytes:
    message = AUTH_CONTEXT + role + b"\x00" + server_nonce + client_nonce + user.encode("utf-8")
    return hmac.new(token, message, hashlib.sha256).digest()


def client_proof(token: bytes, server_nonce: bytes, client_nonce: bytes, user: str) -> bytes:
    """The MAC the client sends in AUTH."""
    return _proof(b"client", token, server_nonce, client_nonce, user)


def server_proof(token: bytes, server_nonce: bytes, client_nonce: bytes, user: str) -> bytes:
    """The MAC the server sends in WELCOME (mutual authentication)."""
    return _proof(b"server", token, server_nonce, client_nonce, user)


def check_server_proof(token: bytes, server_nonce: bytes, client_nonce: bytes, user: str, mac: bytes) -> bool:
    """The client's check of WELCOME's proof, in constant time."""
    return hmac.compare_digest(server_proof(token, server_nonce, client_nonce, user), mac)


class Authenticator:
    """The server's side of the check, over a token source.

    ``tokens`` maps user name to token. ``None`` means open mode, for loopback-only deployments
    without tokens: the user named in HELLO is taken as-is and the server proof is empty. (The
    daemon must refuse a non-loopback listener in open mode; docs/DESIGN.md §9.)
    """

    def __init__(self, tokens: Mapping[str, bytes] | None) -> None:
        self._tokens = tokens
        # An unknown user is checked against this key so that it costs the same HMAC and the same
        # compare_digest as a known one: response time must not reveal which users exist.
        self._dummy_token = os.urandom(32)

    @property
    def open_mode(self) -> bool:
        """True when no tokens are configured and any user name is accepted."""
        return self._tokens is None

    def verify(self, user: str, server_nonce: bytes, client_nonce: bytes, mac: bytes) -> bytes:
        """Check the client's MAC; return the server proof for WELCOME or raise AUTH_FAILED."""
        if self._tokens is None:
            return b""
        token = self._tokens.get(user)
        known = token is not None
        expected = client_proof(
            token if token is not None else self._dummy_token, server_nonce, client_nonce, user
        )
        # compare_digest first and unconditionally, then combine: no early exit on `known`.
        matches = hmac.compare_digest(expected, mac)
        if not (matches and known):
            raise RemoteProtocolError(ErrorCode.AUTH_FAILED, AUTH_FAILED_MESSAGE)
        assert token is not None
        return server_proof(token, server_nonce, client_nonce, user)
