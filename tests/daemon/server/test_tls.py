"""Optional TLS: a server with tls_cert/tls_key serves a client that verifies it with the CA."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from daemon.client import known_servers
from daemon.client.pool_client import PoolClient, ServerUnreachable
from daemon.ctl import one_shot
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.server.certificate import certificate_fingerprint
from protocol import Ping, Pong
from tests.support.pool import running_pool
from tests.support.poolctl import poolctl

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


async def test_tls_round_trip_and_plain_client_refused(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    async with running_pool(redis_server, tmp_path, tls_cert=str(cert), tls_key=str(key)) as pool:
        client = PoolClient(pool.address, "alice", pool.tokens["alice"], tls_ca=str(cert))
        async with client:
            assert isinstance(await client.call(Ping(), Pong), Pong)
        plain = pool.client("alice")
        with pytest.raises(ServerUnreachable):
            await plain.connect(handshake_seconds=2)
        await plain.close()


async def test_a_server_makes_its_own_certificate_and_poolctl_pins_it(
    redis_server: EmbeddedRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 14, finding 8: TLS without set-up, and no one in the middle after the first meeting."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    async with running_pool(redis_server, tmp_path, tls="on") as pool:
        cert = tmp_path / "data" / "tls" / "cert.pem"
        assert cert.exists()
        assert (tmp_path / "data" / "tls" / "key.pem").stat().st_mode & 0o077 == 0
        for _ in range(2):  # the first meeting pins, the second checks
            async with PoolClient(pool.address, "alice", pool.tokens["alice"], tls="on") as client:
                assert isinstance(await client.call(Ping(), Pong), Pong)
        pinned = known_servers.known_servers_file().read_text().split()
        assert pinned == [pool.address, certificate_fingerprint(cert)]

        # Another certificate at that address (a man in the middle, relaying): nothing is sent.
        known_servers.known_servers_file().write_text(f"{pool.address} SHA256:{'0' * 64}\n")
        client = PoolClient(pool.address, "alice", pool.tokens["alice"], tls="on")
        with pytest.raises(known_servers.CertificateChanged, match="someone may be between"):
            await client.connect(handshake_seconds=5)
        plain = PoolClient(pool.address, "alice", pool.tokens["alice"], tls="off")
        with pytest.raises(ServerUnreachable):
            await plain.connect(handshake_seconds=2)
        await plain.close()
    # The certificate is made once: a restart keeps it, and with it every pin.
    async with running_pool(redis_server, tmp_path, tls="on"):
        assert certificate_fingerprint(cert) == pinned[1]


async def test_a_one_request_command_pins_and_checks_the_certificate_as_well(
    redis_server: EmbeddedRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """poolctl's one-request commands go over a blocking socket (one_shot.py), not PoolClient: the
    same pin on first meeting, the same refusal of another certificate, and the CA when given."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    async with running_pool(redis_server, tmp_path, tls="on") as pool:
        token = pool.tokens["alice"]

        def ping(tls: str) -> Pong:
            return one_shot.call(pool.address, "alice", token, Ping(), Pong, tls=tls)

        for _ in range(2):  # in a thread: the server answers on this test's loop
            assert isinstance(await asyncio.to_thread(ping, tls="on"), Pong)
        cert = tmp_path / "data" / "tls" / "cert.pem"
        pinned = known_servers.known_servers_file().read_text().split()
        assert pinned == [pool.address, certificate_fingerprint(cert)]
        known_servers.known_servers_file().write_text(f"{pool.address} SHA256:{'0' * 64}\n")
        with pytest.raises(known_servers.CertificateChanged, match="someone may be between"):
            await asyncio.to_thread(ping, tls="on")
        with pytest.raises(ServerUnreachable):
            await asyncio.to_thread(ping, tls="off")  # a plain client: the TLS server never answers


def test_beyond_loopback_poolctl_speaks_tls_unless_told_otherwise() -> None:
    assert PoolClient("10.1.2.3:7420", "alice", None).tls
    assert not PoolClient("127.0.0.1:7420", "alice", None).tls
    assert PoolClient("127.0.0.1:7420", "alice", None, tls="on").tls
    assert not PoolClient("10.1.2.3:7420", "alice", None, tls="off").tls


async def test_a_plain_client_is_told_the_server_speaks_tls(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """Issue 47 item 9: poolctl speaking plain to a server that speaks TLS only (on this machine,
    where poolctl speaks plain unless told otherwise) said only "closed the connection". It says
    the server speaks TLS and what to set to reach it (README: the pool's entry's tls and
    tls_pin), from a one-request command and from a streaming one alike (exit 3 as before); told
    so, it gets in. A server that closes a plain connection without speaking TLS is not said to."""
    async with running_pool(redis_server, tmp_path, tls="on") as pool:
        env = pool.env("alice")
        for command in (["ls"], ["logs", "default.0000000000aa"]):  # a blocking socket; PoolClient
            code, _, err = await poolctl(env, *command)
            assert code == 3, err
            assert f"the server at {pool.address} speaks TLS only, and poolctl spoke plain to it" in err
            assert 'tls = "on" and its tls_pin' in err
            assert "GPUPOOL_TLS=on" in err
        assert (await poolctl({**env, "GPUPOOL_TLS": "on"}, "ls"))[0] == 0
    with socket.socket() as closing:  # accepts, reads, closes: no TLS
        closing.bind(("127.0.0.1", 0))
        closing.listen(4)
        closing.settimeout(10)
        address = f"127.0.0.1:{closing.getsockname()[1]}"

        def close_each(n: int) -> None:
            for _ in range(n):
                conn, _ = closing.accept()
                conn.recv(1024)
                conn.close()

        closer = asyncio.get_running_loop().run_in_executor(None, close_each, 2)  # the call, a probe
        code, _, err = await poolctl({**env, "GPUPOOL_SERVER": address}, "ls")
        await asyncio.wait_for(closer, 10)
    assert (code, err.strip()) == (3, f"poolctl: the server at {address} closed the connection")
