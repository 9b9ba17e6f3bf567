"""An agent worker's own side (worker/agent.py, relay.py): how it is configured, how it reads its
token, and what the server's answers to its calls mean to a job's run. Its runs for a real server's
worker (daemon/worker/hosted.py) are tested end to end with that side."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from daemon import config
from daemon.client.pool_client import ClientError, PoolClient, ServerUnreachable
from daemon.errors import ConfigError, GpupoolError, JobNotFound, StaleAttempt
from daemon.job import JobSpec, Lease
from daemon.queue.claims import Capacity
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.worker.agent import AgentError
from daemon.worker.job_output import JobOutput
from daemon.worker.pool_link import UNREACHABLE, PoolUnreachable
from daemon.worker.relay import AgentCalls, Relay
from daemon.worker.run_types import Ending
from daemon.worker.runner import JobRun
from daemon.worker.service import read_token
from daemon.worker.spawn import Spawner
from protocol import ErrorCode, Request
from tests.support.paths import ROOT
from tests.support.pool import running_pool
from tests.support.workers import sh

LEASE = Lease("default-1", 1, "w1", JobSpec(argv=("true",)), "w1/r1.0")


def agent_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    token = tmp_path / "token"
    token.write_text("alice-secret\n")
    token.chmod(0o600)
    return {
        "GPUPOOL_WORKER_VIA_SERVER": "127.0.0.1:7420",
        "GPUPOOL_WORKER_SERVE_USER": "alice",
        "GPUPOOL_WORKER_TOKEN_FILE": str(token),
        **extra,
    }


def test_an_agent_needs_no_redis_or_s3_option_but_its_user_and_token(tmp_path: Path) -> None:
    """issue 44 item 1: an agent's configuration names the server, its user and its token file,
    and nothing of Redis or S3; without its token file, or its user, it is refused in a sentence."""
    loaded = config.load(None, env=agent_env(tmp_path))
    assert loaded.worker_via_server == "127.0.0.1:7420"
    assert loaded.main_server_redis_password == ""
    assert loaded.main_server_minio_secret_access_key == ""
    for missing in ("GPUPOOL_WORKER_TOKEN_FILE", "GPUPOOL_WORKER_SERVE_USER"):
        env = agent_env(tmp_path)
        del env[missing]
        with pytest.raises(ConfigError, match=r"a worker through the server .* needs worker_"):
            config.load(None, env=env)


def test_poold_worker_through_a_server_runs_an_agent_not_a_redis_worker(tmp_path: Path) -> None:
    """issue 44 item 1: `poold --worker` with worker_via_server and no Redis or S3 option goes to
    the server (here, an address where none listens: it says it cannot reach it), never to Redis;
    without worker_token_file it refuses at once, saying what to set."""
    with socket.socket() as s:  # a port no one listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env = base | agent_env(tmp_path, GPUPOOL_WORKER_VIA_SERVER=f"127.0.0.1:{port}")
    env |= {"GPUPOOL_DATA_DIR": str(tmp_path / "data"), "GPUPOOL_METRICS_LISTEN": "127.0.0.1:0"}
    argv = [sys.executable, "-m", "daemon.main", "--worker"]
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    assert f"cannot reach the pool server at 127.0.0.1:{port}" in done.stderr
    assert "redis" not in done.stderr.lower()

    del env["GPUPOOL_WORKER_TOKEN_FILE"]
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "needs worker_token_file" in done.stderr


def test_an_agent_reads_only_a_token_file_of_its_own_closed_to_others(tmp_path: Path) -> None:
    """issue 44 item 1: the agent's token lets whoever holds it act as the pool user, so the file
    must be the agent's own, a plain file, mode 600 (or stricter); anything else is refused in a
    sentence saying what to do."""
    token = tmp_path / "token"
    token.write_text("  alice-secret\n")
    token.chmod(0o600)
    assert read_token(str(token)) == "alice-secret"
    token.chmod(0o640)
    with pytest.raises(GpupoolError, match=r"readable by others \(mode 640\): chmod 600"):
        read_token(str(token))
    token.chmod(0o600)
    os.chown(token, 61000, 61000)  # (tests run as root)
    with pytest.raises(AgentError, match="belongs to uid 61000, not to this agent's"):
        read_token(str(token))
    os.chown(token, os.geteuid(), os.getegid())
    (tmp_path / "link").symlink_to(token)
    with pytest.raises(AgentError, match="must be a plain file"):
        read_token(str(tmp_path / "link"))
    with pytest.raises(AgentError, match="does not exist"):
        read_token(str(tmp_path / "none"))
    token.write_text("\n")
    with pytest.raises(AgentError, match="is empty"):
        read_token(str(token))


class Answers(PoolClient):
    """A client, its connection open, whose every call is answered with an ERROR of `code` (the
    relay's reading of the answers is under test; the wire is tests/daemon/client's)."""

    def __init__(self, code: int) -> None:
        super().__init__("127.0.0.1:7420", "alice", None)
        self.code = code

    async def call(self, request: Request, reply_type: type[Any]) -> Any:
        raise ClientError("answered so", self.code)


@pytest.mark.parametrize(
    ("code", "append", "record", "read"),
    [
        (ErrorCode.CONFLICT, StaleAttempt, False, ClientError),
        (ErrorCode.PERMISSION_DENIED, StaleAttempt, False, ClientError),
        (ErrorCode.NOT_FOUND, ClientError, ClientError, JobNotFound),
        (ErrorCode.UNKNOWN_OP, ClientError, ClientError, ClientError),  # an answer, not a lost link
        (ErrorCode.UNAVAILABLE, PoolUnreachable, PoolUnreachable, PoolUnreachable),
        (ErrorCode.SHUTTING_DOWN, PoolUnreachable, PoolUnreachable, PoolUnreachable),
    ],
)
async def test_the_servers_answers_mean_to_a_run_what_redis_answers_mean_to_a_workers(
    code: ErrorCode, append: type[Exception], record: bool | type[Exception], read: type[Exception]
) -> None:
    """issue 44 item 1: an append the server refuses (no longer current, or not this agent's)
    is StaleAttempt, so the run kills the job; a refused checkpoint record is not recorded; no
    job is JobNotFound; a server without its Redis, or stopping, is PoolUnreachable, which the
    run waits out as it waits out a Redis hiccup; any other answer is the server's error."""
    relay = Relay(AgentCalls(Answers(code), "w1", b"k" * 32), LEASE)
    with pytest.raises(append) as caught:
        await relay.append_log(LEASE, 1, [b"out"])
    assert type(caught.value) is append
    if isinstance(record, bool):
        assert await relay.record_checkpoint(LEASE, "w1%2Fr1.0.1") is record
    else:
        with pytest.raises(record):
            await relay.record_checkpoint(LEASE, "w1%2Fr1.0.1")
    with pytest.raises(read) as caught:
        await relay.get(LEASE.job_id)
    assert type(caught.value) is read
    with pytest.raises(read):
        await relay.read_log(LEASE.job_id, "0-0", count=10)


async def test_a_run_keeps_its_output_while_the_server_is_away(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 44 item 1: a real connection to a real server that stops: the attempt's relay says
    PoolUnreachable (one of UNREACHABLE), and the job's output is kept to send again, not
    dropped, nor the job killed, as for a worker whose Redis is briefly away."""
    async with running_pool(redis_server, tmp_path) as pool:
        client = pool.client()
        await client.connect()
        await pool.server.stop()
    relay = Relay(AgentCalls(client, "w1", b"k" * 32), LEASE)
    refused: list[str] = []
    try:
        with pytest.raises(UNREACHABLE) as caught:
            await relay.append_log(LEASE, 1, [b"out"])
        assert isinstance(caught.value, PoolUnreachable)
        assert isinstance(caught.value.__cause__, ServerUnreachable | ClientError)
        output = JobOutput(relay, LEASE, refused.append)
        output.note("hello")
        await output.flush()
        assert not output.closed
        assert refused == []
        assert output._pending()  # what is kept to send again
    finally:
        await client.close()


async def test_a_run_says_its_first_process_ended_as_it_ends(
    spawner: Spawner, queue: JobQueue, tmp_path: Path
) -> None:
    """issue 44 item 1: the agent tells the server `exited` when the job's first process ends (the
    server's worker stops renewing an attempt whose processes are gone, as a worker does): JobRun
    says so at that moment, before its output, checkpoint and artifacts are done with."""
    spec = sh("sleep 0.1; echo done")
    await queue.enqueue(spec)
    lease = await queue.claim("w1", [spec.queue], Capacity(gpus_free=8))
    assert lease is not None
    seen: list[tuple[bool, bool]] = []
    run: JobRun | None = None

    def exited() -> None:
        assert run is not None
        seen.append((run.exited, ended.done()))

    run = JobRun(queue, lease, spawner=spawner, data_dir=tmp_path, on_exit=exited)
    ended = asyncio.ensure_future(run.run())
    result = await ended
    assert result.ending is Ending.EXITED
    assert seen == [(True, False)]
    await run.tidy()


def test_an_agents_outcome_cannot_carry_gpu_usage() -> None:
    """Issue 50, per-job GPU usage and accounting: an agent's job gets no NVML readings, so a
    `gpu_usage` in the outcome an agent sends is dropped, never recorded as measured (it would
    reach acct's efficiency on the agent's word); the rest of its result is kept."""
    from daemon.worker.hosted import run_result

    said = {
        "ending": "exited",
        "outcome": {
            "state": "succeeded",
            "exit_code": 0,
            "detail": "",
            "result": {"gpu_usage": {"efficiency": 1.0}, "tail": "ok"},
        },
    }
    result = run_result(said, (), LEASE)
    assert result.outcome is not None
    assert result.outcome.result == {"tail": "ok"}
