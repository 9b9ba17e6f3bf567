"""A single-machine pool's Unix socket: poolctl on that machine reaches the server through it
(no TCP stack on the way), with the same handshake and tokens, against a real embedded server."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from daemon import config, tokens
from daemon.client.pool_client import ClientError, PoolClient
from daemon.client.session import parse_address
from daemon.job import JobState
from daemon.pools import LOCAL, choose
from daemon.server.service import PoolServer
from protocol import Enqueue, Enqueued, JobDetail, ShowJob
from tests.support.poolctl import poolctl


def embedded_pool(data: Path) -> PoolServer:
    """The pool `make run` starts, its data in `data` (no local slots: nothing here needs a job
    to run)."""
    env = {
        "GPUPOOL_DATA_DIR": str(data),
        "GPUPOOL_LISTEN": "127.0.0.1:0",
        "GPUPOOL_METRICS_LISTEN": "127.0.0.1:0",
        "GPUPOOL_WEB_LISTEN": "off",
        "GPUPOOL_WORKER_LOCAL_PROCESSORS": "0",
    }
    return PoolServer(config.load(None, env=env))


@pytest.fixture
async def embedded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[PoolServer]:
    """`embedded_pool`, started."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))  # where it registers itself
    server = embedded_pool(tmp_path / "data")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def test_poolctl_on_the_machine_reaches_a_single_machine_pool_through_its_socket(
    embedded: PoolServer, tmp_path: Path
) -> None:
    assert embedded.listener is not None
    path = embedded.listener.socket
    assert path == tmp_path / "data" / "pool.sock"
    assert stat.S_ISSOCK(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666  # every local user, as the loopback port
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path)}
    local = choose(None, None, env=env)
    assert (local.name, local.server) == (LOCAL, f"unix:{path}")

    # the library through it: the same handshake and token
    async with PoolClient(local.server, tokens.local_user(), tokens.client_token()) as client:
        job_id = (await client.call(Enqueue({"argv": ["true"]}, None), Enqueued)).job_id
        info = await client.call(ShowJob(job_id), JobDetail)
        assert info.job["state"] == str(JobState.QUEUED)
    with pytest.raises(ClientError, match="refused"):
        async with PoolClient(local.server, tokens.local_user(), "not-the-token"):
            pass

    # poolctl, with no set-up but what the server registered
    researcher = {**env, "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GPUPOOL_USER": tokens.local_user()}
    code, out, err = await poolctl(researcher, "ls", "--format", "id", "--no-header")
    assert (code, out.split()) == (0, [job_id]), err

    await embedded.stop()
    assert not path.exists()


async def test_a_socket_left_by_a_server_that_died_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    left = socket.socket(socket.AF_UNIX)
    left.bind(str(data / "pool.sock"))  # bound, never listening: nobody answers there
    left.close()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    server = embedded_pool(data)
    await server.start()
    try:
        assert server.listener is not None
        async with PoolClient(server.listener.local_address, tokens.local_user(), tokens.client_token()) as c:
            assert (await c.call(Enqueue({"argv": ["true"]}, None), Enqueued)).job_id
    finally:
        await server.stop()


def test_a_socket_address_must_name_a_path() -> None:
    assert parse_address("unix:/run/pool.sock") == ("unix:/run/pool.sock", 0)
    with pytest.raises(ClientError, match="expected unix:PATH"):
        parse_address("unix:")
