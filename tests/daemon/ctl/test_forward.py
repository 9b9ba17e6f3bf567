"""Issue 49: `poolctl forward JOB [LOCAL:]PORT` reaches a port inside a running job, end to end: a
real pool server, a real `poold --worker` process running jobs as slot uids, a job serving HTTP,
and `poolctl` as a subprocess, as a researcher runs it (test_exec.py's pool and worker)."""

from __future__ import annotations

import asyncio
import re
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from daemon.job import JobSpec
from daemon.queue import channels, registry
from daemon.queue.embedded_redis import EmbeddedRedis
from tests.daemon.ctl.test_exec import log_text, running_job
from tests.support.paths import ROOT
from tests.support.pool import running_pool
from tests.support.poolctl import poolctl
from tests.support.workers import wait_until

DATA = "".join(f"{n}\n" for n in range(1, 20001)).encode()  # `seq 1 20000`: 109 KiB, more than a chunk
GET = b"GET /data.txt HTTP/1.0\r\n\r\n"


def serving(port: int) -> str:
    """A job that serves its directory, holding DATA, on 127.0.0.1:`port` (its loopback)."""
    return f"seq 1 20000 > data.txt; exec /usr/bin/python3 -u -m http.server {port} --bind 127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@asynccontextmanager
async def forwarding(
    env: dict[str, str], job_id: str, port: int
) -> AsyncIterator[tuple[asyncio.subprocess.Process, int]]:
    """`poolctl forward JOB 0:PORT` running, with the local port it printed."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "daemon.ctl.cli", "forward", job_id, f"0:{port}",
        env={**env, "PYTHONPATH": str(ROOT)}, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        found = re.fullmatch(
            rf"forwarding 127\.0\.0\.1:(\d+) to port {port} in job {job_id} \(Ctrl-C ends it\)\n", line
        )
        assert found, line
        yield proc, int(found[1])
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def fetch(local: int) -> bytes:
    """GET /data.txt through the forward: the body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", local)
    writer.write(GET)
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200"), head
    return body


async def test_forward_serves_many_connections_only_for_its_owner_and_ends_with_its_job(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    """Issue 49, `forward` done-when: `poolctl forward` to an HTTP server inside a running job
    (on the job's loopback, the worker's network) relays 20 concurrent requests, each with the
    right bytes, each recorded in the job's log; bob is refused with a sentence and exit 6 before
    anything is listened on or connected; a quiet connection is made once, however long it
    waits; the job's end ends `poolctl forward` (exit 0) and closes a connection still open
    through it."""
    port = free_port()
    job = running_job(redis_server, tmp_path, s3_env, command=serving(port), ready_line="Serving HTTP")
    async with job as (pool, job_id, _):
        code, out, err = await poolctl(pool.env("bob"), "forward", job_id, str(port))
        assert (code, out) == (6, ""), err
        refusal = f"job {job_id} belongs to alice: only its owner or a pool admin may forward to it"
        assert err == f"poolctl: {refusal}\n"
        code, _, err = await poolctl(pool.env("alice"), "forward", "default.nosuchjob", str(port))
        assert code == 5, err

        async with forwarding(pool.env("alice"), job_id, port) as (proc, local):
            bodies = await asyncio.gather(*(fetch(local) for _ in range(20)))
            assert all(body == DATA for body in bodies)

            async def logged() -> bool:  # the job's output reaches its log in batches
                text = await log_text(pool.queue, job_id)
                return text.count('"GET /data.txt HTTP/1.0" 200') == 20

            await wait_until(logged, 10, "the job to log 20 requests")
            text = await log_text(pool.queue, job_id)
            assert text.count(f"[gpupool] forward by alice to port {port}") == 20, text
            assert "bob" not in text

            # A connection open and quiet for longer than the server waits to hear from the
            # worker (channels.BLOCK), which then tells the worker again: it is still one.
            reader, writer = await asyncio.open_connection("127.0.0.1", local)
            lines = f"[gpupool] forward by alice to port {port}"

            async def connected() -> bool:
                return (await log_text(pool.queue, job_id)).count(lines) == 21

            await wait_until(connected, 10, "the quiet connection to be made")
            await asyncio.sleep(channels.BLOCK * 1.2)
            assert (await log_text(pool.queue, job_id)).count(lines) == 21
            await pool.queue.cancel(job_id)
            began = time.monotonic()
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed with the job
            writer.close()
            assert await asyncio.wait_for(proc.wait(), 10) == 0
            assert time.monotonic() - began < 5
            assert proc.stderr is not None
            said = (await proc.stderr.read()).decode()
            assert said.endswith(f"poolctl: job {job_id} cancelled: its forward has ended\n"), said


async def test_forward_reaches_the_loopback_of_a_job_with_a_network_of_its_own(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    """Issue 49, `forward` "as the job sees it": where jobs have a network of their own
    (`job_network = "private"`), a forward reaches the port on the job's loopback, which the
    worker's own loopback does not have (a connection there is refused)."""
    port = free_port()
    job = running_job(
        redis_server,
        tmp_path,
        s3_env,
        command=serving(port),
        ready_line="Serving HTTP",
        worker_options=("--job-network", "private"),
    )
    async with job as (pool, job_id, _), forwarding(pool.env("alice"), job_id, port) as (proc, local):
        assert [*await asyncio.gather(fetch(local), fetch(local))] == [DATA, DATA]
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except ConnectionRefusedError:
            pass
        else:
            writer.close()
            raise AssertionError(f"port {port} is open on the worker's loopback: the job shares it")
        assert proc.returncode is None


async def test_forward_into_a_queued_job_or_an_agents_is_refused_in_a_sentence(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """Issue 49, `forward`'s refusals, as exec's: a job not running yet, and one running on an
    agent's machine, each get a sentence saying so and exit status 2 before anything listens; a
    pool admin passes the owner's check (and meets the refusal of a job not running); bob does
    not (exit 6). A port out of range is a usage error."""
    async with running_pool(
        redis_server, tmp_path, users=("alice", "bob", "carol"), admins=("carol",)
    ) as pool:
        queued, _ = await pool.queue.enqueue(JobSpec(argv=("true",), user="alice"))
        not_running = f"job {queued} is queued, not running: forward reaches a port inside a running job"
        said = await poolctl(pool.env("carol"), "forward", queued, "8888")
        assert said == (2, "", f"poolctl: {not_running}\n")
        code, _, _ = await poolctl(pool.env("bob"), "forward", queued, "8888")
        assert code == 6
        agent = registry.agent_worker_id("laptop")
        lease = await pool.queue.claim(agent, ["default"])
        assert lease is not None
        assert lease.job_id == queued
        code, out, err = await poolctl(pool.env("alice"), "forward", queued, "8888")
        assert (code, out) == (2, "")
        assert err == (
            f"poolctl: job {queued} runs on an agent's machine ({agent}), where forward is not supported "
            "yet; serve the port from the pool's own workers\n"
        )
        code, _, err = await poolctl(pool.env("alice"), "forward", queued, "8888:0")
        assert code == 2
        assert "'8888:0' is no [LOCAL:]PORT" in err
