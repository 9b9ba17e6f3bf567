"""Two `poold` servers on one Redis, and `poolctl` given both (GPUPOOL_SERVER=a,b): a server that
is down is passed over; one that goes away in the middle of a `wait` or a `logs -f` is left for
the other, which goes on where the first stopped: each job's end printed once, each log line once."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from daemon.job import JobState
from daemon.queue.embedded_redis import EmbeddedRedis, free_port
from daemon.queue.job_queue import JobQueue
from tests.support.paths import ROOT
from tests.support.poolctl import poolctl
from tests.support.poold_proc import poold_process
from tests.support.workers import running_worker, sh, wait_state

TOKENS = {"alice": "alice-token-0123456789abcdef"}


def env_for(servers: str, tmp: Path) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp),
        "XDG_CONFIG_HOME": str(tmp / "xdg"),
        "GPUPOOL_SERVER": servers,
        "GPUPOOL_USER": "alice",
        "GPUPOOL_TOKEN": TOKENS["alice"],
    }


@asynccontextmanager
async def closing(queue: JobQueue) -> AsyncIterator[JobQueue]:
    try:
        yield queue
    finally:
        await queue.redis.aclose()


async def started(env: dict[str, str], *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "daemon.ctl.cli",
        *args,
        env={**env, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_a_server_that_is_down_is_passed_over(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    with poold_process(redis_server, tmp_path / "b", TOKENS) as (b, _):
        down = f"127.0.0.1:{free_port()}"
        env = env_for(f"{down},{b}", tmp_path)
        code, out, err = await poolctl(env, "enqueue", "--key", "k1", "--", "true")
        assert code == 0, err
        assert f"going on with the server at {b}" in err
        code, listed, _ = await poolctl(env, "ls")
        assert code == 0
        assert out.strip() in listed
        code, _, err = await poolctl(env_for(down, tmp_path), "ls")
        assert code != 0
        assert f"cannot reach the pool server at {down}" in err


async def test_a_wait_goes_on_with_the_other_server_when_its_own_stops(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    async with closing(JobQueue(redis_server.client())) as queue:
        await wait_goes_on(redis_server, queue, tmp_path)


async def wait_goes_on(redis_server: EmbeddedRedis, queue: JobQueue, tmp_path: Path) -> None:
    ended, _ = await queue.enqueue(sh("true", user="alice"))
    await queue.cancel(ended)  # ended before the wait: streamed at once, by each server it asks
    waiting, _ = await queue.enqueue(sh("true", user="alice"))  # no worker: it waits until cancelled
    with (
        poold_process(redis_server, tmp_path / "a", TOKENS) as (a, first),
        poold_process(redis_server, tmp_path / "b", TOKENS) as (b, _),
    ):
        wait = await started(env_for(f"{a},{b}", tmp_path), "wait", ended, waiting)
        assert wait.stdout is not None
        line = await asyncio.wait_for(wait.stdout.readline(), 30)
        assert line.decode().startswith(f"{ended}\tcancelled")
        first.send_signal(signal.SIGTERM)  # it says goodbye, and the wait moves to b
        await asyncio.to_thread(first.wait, 30)
        await asyncio.sleep(0.5)
        await queue.cancel(waiting)
        out, err = await asyncio.wait_for(wait.communicate(), 30)
    lines = (line + out).decode().splitlines()
    assert [x.split("\t")[:2] for x in lines] == [[ended, "cancelled"], [waiting, "cancelled"]], lines
    assert f"going on with the server at {b}" in err.decode()
    assert "Traceback" not in err.decode()
    assert wait.returncode == 1  # not every job succeeded


async def test_logs_follow_goes_on_with_the_other_server_from_where_it_was(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    async with closing(JobQueue(redis_server.client(), lease_seconds=30)) as queue:
        await logs_go_on(redis_server, queue, tmp_path)


async def logs_go_on(redis_server: EmbeddedRedis, queue: JobQueue, tmp_path: Path) -> None:
    job_id, _ = await queue.enqueue(
        sh("for i in $(seq 1 40); do echo line $i; sleep 0.05; done", user="alice")
    )
    with (
        poold_process(redis_server, tmp_path / "a", TOKENS) as (a, first),
        poold_process(redis_server, tmp_path / "b", TOKENS) as (b, _),
    ):
        follow = await started(env_for(f"{a},{b}", tmp_path), "logs", "-f", job_id)
        assert follow.stdout is not None
        async with running_worker(queue, tmp_path / "w"):
            head = [await asyncio.wait_for(follow.stdout.readline(), 30) for _ in range(5)]
            first.kill()  # gone at once, no goodbye: the connection resets
            out, err = await asyncio.wait_for(follow.communicate(), 60)
            await wait_state(queue, job_id, JobState.SUCCEEDED)
    printed = (b"".join(head) + out).decode().splitlines()
    assert printed == [f"line {i}" for i in range(1, 41)], printed
    assert f"going on with the server at {b}" in err.decode()
    assert follow.returncode == 0
