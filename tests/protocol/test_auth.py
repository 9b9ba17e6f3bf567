"""HMAC challenge-response: exact input bytes, mutual proofs, indistinguishable failures."""

import hashlib
import hmac

import pytest

from protocol import auth
from protocol.errors import ErrorCode, RemoteProtocolError

TOKEN = b"alice-secret-token-0123456789abc"
SERVER_NONCE = b"S" * 32
CLIENT_NONCE = b"C" * 32


def test_proofs_use_the_documented_bytes() -> None:
    message = b"gpupool-auth-v1\x00client\x00" + SERVER_NONCE + CLIENT_NONCE + "ålice".encode()
    expected = hmac.new(TOKEN, message, hashlib.sha256).digest()
    assert auth.client_proof(TOKEN, SERVER_NONCE, CLIENT_NONCE, "ålice") == expected
    server_message = message.replace(b"\x00client\x00", b"\x00server\x00")
    assert (
        auth.server_proof(TOKEN, SERVER_NONCE, CLIENT_NONCE, "ålice")
        == hmac.new(TOKEN, server_message, hashlib.sha256).digest()
    )


def test_client_and_server_proofs_differ() -> None:
    # Otherwise a man in the middle could reflect the client's proof back as the server's.
    assert auth.client_proof(TOKEN, SERVER_NONCE, CLIENT_NONCE, "a") != auth.server_proof(
        TOKEN, SERVER_NONCE, CLIENT_NONCE, "a"
    )


def test_nonces_are_fresh() -> None:
    nonces = {auth.new_nonce() for _ in range(100)}
    assert len(nonces) == 100
    assert all(len(nonce) == 32 for nonce in nonces)


def test_verify_accepts_the_right_token() -> None:
    authenticator = auth.Authenticator({"alice": TOKEN})
    mac = auth.client_proof(TOKEN, SERVER_NONCE, CLIENT_NONCE, "alice")
    server_mac = authenticator.verify("alice", SERVER_NONCE, CLIENT_NONCE, mac)
    assert auth.check_server_proof(TOKEN, SERVER_NONCE, CLIENT_NONCE, "alice", server_mac)
    assert not auth.check_server_proof(b"other", SERVER_NONCE, CLIENT_NONCE, "alice", server_mac)


@pytest.mark.parametrize(
    ("user", "token", "server_nonce"),
    [
        ("alice", b"wrong", SERVER_NONCE),  # wrong token
        ("mallory", TOKEN, SERVER_NONCE),  # unknown user
        ("alice", TOKEN, b"X" * 32),  # proof made for another server nonce (a replay)
    ],
)
def test_failures_are_indistinguishable(user: str, token: bytes, server_nonce: bytes) -> None:
    authenticator = auth.Authenticator({"alice": TOKEN})
    mac = auth.client_proof(token, server_nonce, CLIENT_NONCE, user)
    with pytest.raises(RemoteProtocolError) as caught:
        authenticator.verify(user, SERVER_NONCE, CLIENT_NONCE, mac)
    assert caught.value.code is ErrorCode.AUTH_FAILED
    assert caught.value.message == auth.AUTH_FAILED_MESSAGE


def test_unknown_user_with_the_dummy_path_never_passes() -> None:
    authenticator = auth.Authenticator({})
    for mac in (b"", b"\x00" * 32):
        with pytest.raises(RemoteProtocolError):
            authenticator.verify("nobody", SERVER_NONCE, CLIENT_NONCE, mac)


def test_open_mode_accepts_anyone_without_proof() -> None:
    authenticator = auth.Authenticator(None)
    assert authenticator.open_mode
    assert authenticator.verify("whoever", SERVER_NONCE, CLIENT_NONCE, b"") == b""


def test_documented_vector() -> None:
    # The test vector in docs/PROTOCOL.md §4: keep the two in step.
    token, client_nonce, server_nonce = b"alice-secret-token", bytes(range(32)), bytes(range(0x40, 0x60))
    assert auth.client_proof(token, server_nonce, client_nonce, "alice").hex() == (
        "2828f0c62362b0101a8292cd80b1010ed6be4dafca6346c405cc627557ddf411"
    )
    assert auth.server_proof(token, server_nonce, client_nonce, "alice").hex() == (
        "6863458aee08e190ec3efe8abb981b99fde5869cbadf8950773a62835294cd7c"
    )
