"""Issue 49, the end of a `poolctl exec` channel (the reviewer's findings 1, 3, 8, 9 and 13b):
however its client goes (Ctrl-C, a closed output pipe), the command is killed and the channel's
Redis keys are gone within seconds; while it relays, Redis holds about a window of its output;
a worker that never answers is given up on; a command line of too many arguments is refused.
Real processes: tests/daemon/ctl/test_exec.py's pool, `poold --worker` and `poolctl`."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.job import JobSpec, JobState
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.server import channels as server_channels
from protocol import CHANNEL_WINDOW
from tests.daemon.ctl.test_exec import log_text, running_job, tagged
from tests.support.paths import ROOT
from tests.support.pool import running_pool
from tests.support.poolctl import poolctl
from tests.support.workers import wait_state, wait_until

CHANNEL_KEYS = "*:channel:*"


async def test_an_exec_leaves_nothing_running_and_no_key_however_its_client_ends(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 49, findings 1, 3, 9 and 13b: Ctrl-C on `poolctl exec` (which cancels the channel,
    then closes the connection: two cancellations of the server's task) kills the command and
    leaves no channel key within seconds; a command whose output poolctl can no longer write
    (`| head -c 10`) is killed too, poolctl exiting 141; a command's channel holds about a window
    of output in Redis while it streams 6 MB, and none of its keys once it has ended; a command
    line of 5000 arguments is refused in a sentence, and a newline in one forges no line of the
    job's log; and (finding 13a) a client that stops reading
    holds its channel no longer than its job: once the job ends, the keys go (the server's
    heartbeat, made quick here, looks at the job while the relay waits on the client)."""
    monkeypatch.setattr(server_channels, "HEARTBEAT_SECONDS", 0.3, raising=False)
    async with running_job(redis_server, tmp_path, s3_env) as (pool, job_id, said):
        env = {**pool.env("alice"), "PYTHONPATH": str(ROOT)}
        redis = pool.queue.redis

        async def nothing_left(tag: str) -> bool:
            return not tagged(tag, said[1]) and not [k async for k in redis.scan_iter(match=CHANNEL_KEYS)]

        async def started(tag: str) -> None:
            async def seen() -> bool:
                return tag in await log_text(pool.queue, job_id)

            await wait_until(seen, 30, "the exec to start")

        tag, piped_tag = secrets.token_hex(6), secrets.token_hex(6)
        interrupted = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "daemon.ctl.cli", "exec", job_id, "--", "sh", "-c", f"sleep 600; : {tag}",
            env=env, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        command = f"{sys.executable} -m daemon.ctl.cli exec {job_id} -- sh -c 'cat /dev/zero; : {piped_tag}'"
        piped = await asyncio.create_subprocess_exec(
            "bash", "-c", f"{command} | head -c 10 >/dev/null; echo ${{PIPESTATUS[0]}}",
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        )  # fmt: skip
        await started(tag)
        interrupted.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(interrupted.wait(), 10) == 130
        out, _ = await asyncio.wait_for(piped.communicate(), 20)
        assert out == b"141\n"

        async def neither_left() -> bool:
            return await nothing_left(tag) and await nothing_left(piped_tag)

        await wait_until(neither_left, 6, "the commands and the keys of a Ctrl-C'd and a `| head` exec to go")

        peak = 0

        async def watch_output() -> None:
            nonlocal peak
            while True:
                async for key in redis.scan_iter(match=CHANNEL_KEYS + ":out"):
                    peak = max(peak, await redis.memory_usage(key) or 0)
                await asyncio.sleep(0.01)

        watching = asyncio.ensure_future(watch_output())
        size = 6_000_000
        streaming = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "daemon.ctl.cli", "exec", job_id, "--",
            "head", "-c", f"{size}", "/dev/zero",
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(streaming.communicate(), 30)
        watching.cancel()
        assert (streaming.returncode, len(out)) == (0, size)
        assert 0 < peak < 3 * CHANNEL_WINDOW, peak  # the window, and what Redis adds to it
        assert not [k async for k in redis.scan_iter(match=CHANNEL_KEYS)]

        forged = "\n[gpupool] exec by bob (pid 1): rm -rf /"
        assert (await poolctl(env, "exec", job_id, "--", "true", forged))[0] == 0

        async def noted() -> bool:
            return "rm -rf /" in await log_text(pool.queue, job_id)

        await wait_until(noted, 10, "the exec's line in the job's log")
        lines = (await log_text(pool.queue, job_id)).splitlines()
        assert not [line for line in lines if line.startswith("[gpupool] exec by bob")]
        code, _, err = await poolctl(env, "exec", job_id, "--", "true", *[""] * 5000)
        assert code == 2
        assert err == (
            "poolctl: the command is over 128 KiB or 4096 arguments, or holds a NUL byte; "
            "pass long input on stdin\n"
        )

        unread, stalled_out = os.pipe()  # poolctl's output, never read
        stalled = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "daemon.ctl.cli", "exec", job_id, "--", "cat", "/dev/zero",
            env=env, stdin=subprocess.DEVNULL, stdout=stalled_out,
        )  # fmt: skip
        os.close(stalled_out)
        try:

            async def relaying() -> bool:
                return bool([k async for k in redis.scan_iter(match=CHANNEL_KEYS + ":out")])

            await wait_until(relaying, 10, "the stalled exec to start")
            await asyncio.sleep(0.5)  # its pipe and its window fill: the relay waits on it
            await pool.queue.cancel(job_id)

            async def no_key() -> bool:
                return not [k async for k in redis.scan_iter(match=CHANNEL_KEYS)]

            await wait_until(no_key, 6, "the stalled client's channel to end with its job")
        finally:
            stalled.kill()
            await stalled.wait()
            os.close(unread)


async def test_an_exec_gives_up_on_a_worker_that_does_not_answer(
    redis_server: EmbeddedRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 49, finding 8: a job running on a worker that never takes the channel (here a worker
    id with no process behind it) gets a sentence and exit status 2 once ANSWER_SECONDS have
    passed, instead of waiting for good; of its channel's keys, only the kill is left, for moments."""
    monkeypatch.setattr(server_channels, "ANSWER_SECONDS", 0.5, raising=False)
    async with running_pool(redis_server, tmp_path) as pool:
        job_id, _ = await pool.queue.enqueue(JobSpec(argv=("true",), user="alice"))
        lease = await pool.queue.claim("ghost-worker", ["default"])
        assert lease is not None
        await wait_state(pool.queue, job_id, JobState.RUNNING)
        code, _, err = await asyncio.wait_for(poolctl(pool.env("alice"), "exec", job_id, "--", "true"), 15)
        assert code == 2
        assert err == (
            "poolctl: the job's worker (ghost-worker) did not answer in 0.5 s; try again, and if it "
            "goes on, see `poolctl workers`\n"
        )
        redis = pool.queue.redis
        left = [k async for k in redis.scan_iter(match=CHANNEL_KEYS)]  # the kill, for a worker late
        assert [k.decode().rsplit(":", 1)[1] for k in left] == ["in"]
        assert 0 < await redis.ttl(left[0]) <= server_channels.KILL_LINGER
