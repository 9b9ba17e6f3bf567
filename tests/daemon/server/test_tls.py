"""Optional TLS: a server with tls_cert/tls_key serves a client that verifies it with the CA."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from daemon.ctl.pool_client import PoolClient, ServerUnreachable
from daemon.queue.embedded_redis import EmbeddedRedis
from protocol import Ping, Pong
from tests.support.pool import running_pool

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
