"""Issue 49: how an exec ends, on a real `poolctl exec` into a real `poold --worker`'s job run as
a slot uid (test_exec.py's fixtures): a command killed by a real-time signal, a client that reads
slowly, and an exec that arrives while its job is ending."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import sys
import time
from pathlib import Path

import psutil

from daemon.job import JobSpec, JobState
from daemon.queue import keys
from daemon.queue.connection import AnyRedis
from daemon.queue.embedded_redis import EmbeddedRedis
from tests.daemon.ctl.test_exec import log_text, running_job
from tests.support.paths import ROOT
from tests.support.poolctl import poolctl
from tests.support.workers import wait_state, wait_until

OUTPUT_BYTES = 600_000  # the windows and pipes on its way hold all but what its own pipe holds
UNREAD_SECONDS = 6  # how long the output waits unread: longer than execs.DRAIN_SECONDS, the old cut-off
# A job that leaves many files in /tmp (its end sweeps them, a while), says so, and exits.
ENDING_JOB = (
    "python3 -c \"import os, sys; d = '/tmp/gpupool-ending-' + sys.argv[1]; os.mkdir(d); "
    "[open(d + '/' + str(i), 'w').close() for i in range(20000)]\" {tag}; echo last"
)


async def server_gone_ends_an_exec(redis: AnyRedis, env: dict[str, str], job_id: str) -> None:
    """Issue 49, review findings 1, 3 and 8 on the worker's side: the worker's first entry for a
    channel says it has taken it (t=1: its server stops telling it again); the input it has read
    is deleted from Redis (all of it stayed, up to 512 entries); and a channel whose record says
    its server's heartbeat is past (`alive_until`) is ended, its command killed (it ran on while
    anything refreshed the record)."""
    tag = secrets.token_hex(6)
    command = f"cat > /dev/null; sleep 600; : {tag}"
    execing = asyncio.ensure_future(
        poolctl(env, "exec", job_id, "--", "sh", "-c", command, stdin=b"x" * 300_000)
    )
    record = ""

    async def opened() -> bool:
        nonlocal record
        async for key in redis.scan_iter(match=keys.channel(job_id, "*")):
            name = key.decode()
            if await redis.type(name) == b"hash" and tag.encode() in (await redis.hget(name, "argv") or b""):
                record = name
        return bool(record)

    await wait_until(opened, 30, "the exec's channel to open")
    inbound = record + ":in"

    async def taken() -> bool:  # input was added, and the worker deleted all it read
        info = await redis.xinfo_stream(inbound)
        return info["length"] == 0 and info["last-generated-id"] not in (b"0-0", "0-0")

    await wait_until(taken, 5, "the worker to delete the input it has read")
    # (Its first entry, t=1, the server reads and deletes at once: the server's test,
    # test_exec_end.py, sees the server stop telling a worker that answered.)
    assert await redis.hget(record, "taken")
    deadline = time.monotonic() + 10
    while not execing.done() and time.monotonic() < deadline:  # its server's heartbeat: long past
        await redis.hset(record, "alive_until", str(time.time() - 60))
        await asyncio.wait({execing}, timeout=0.1)
    code, _, err = await asyncio.wait_for(execing, 1)
    assert code == 137
    assert err == f"poolctl: sh in {job_id}: killed by SIGKILL (its channel's server went away)\n"


async def test_an_exec_ends_on_a_realtime_signal_relays_all_to_a_slow_reader_never_outlives_its_job(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    """Issue 49, `exec` (reviewer's findings 5, 4 and 2 on the worker's side):
    - a command killed by a real-time signal (40: no name of Python's) ends its exec at once with
      status 168 and a sentence naming the signal (the worker wrote no end: poolctl hung);
    - a client that reads nothing for longer than the worker's old drain limit still gets every
      byte the command wrote, and its exit code 0 (it was cut off silently, exit code 0);
    - execs that arrive after a job's last line, while its end is being made (its first process
      reaped, its uid being swept), are refused or killed with it: once the job has ended no
      process of its uid is left, `setsid -f` ones included (they outlived the job);
    - findings 1, 3 and 8: see server_gone_ends_an_exec."""
    async with running_job(redis_server, tmp_path, s3_env) as (pool, job_id, _):
        env = pool.env("alice")
        go = tmp_path / "read now"  # the slow reader reads once the test makes it
        reading = await asyncio.create_subprocess_exec(
            "bash", "-c",
            f"{sys.executable} -m daemon.ctl.cli exec {job_id} -- head -c {OUTPUT_BYTES} /dev/zero "
            f"| (while [ ! -e '{go}' ]; do sleep 0.05; done; wc -c); echo ${{PIPESTATUS[0]}}",
            env={**env, "PYTHONPATH": str(ROOT)}, stdout=asyncio.subprocess.PIPE, start_new_session=True,
        )  # fmt: skip

        try:

            async def head_started() -> bool:
                return "[gpupool] exec by alice" in await log_text(pool.queue, job_id)

            await wait_until(head_started, 30, "the slow reader's command to start")
            read_at = time.monotonic() + UNREAD_SECONDS  # its command has ended by then, long since

            code, out, err = await asyncio.wait_for(
                poolctl(env, "exec", job_id, "--", "sh", "-c", "kill -40 $$"), 20
            )
            assert (code, out) == (128 + 40, "")
            assert err == f"poolctl: sh in {job_id}: killed by SIGRTMIN+{40 - signal.SIGRTMIN}\n"

            await server_gone_ends_an_exec(pool.queue.redis, env, job_id)

            tag = secrets.token_hex(6)
            ending, _ = await pool.queue.enqueue(
                JobSpec(argv=("sh", "-c", ENDING_JOB.format(tag=tag)), gpus=1, user="alice")
            )

            await wait_state(pool.queue, ending, JobState.RUNNING)
            # Execs one after another from its start to its end: some arrive while its end is made.
            stay = f"setsid -f sleep 1000; : {tag}"
            late: list[asyncio.Future[tuple[int, str, str]]] = []
            while not (await pool.queue.get(ending)).state.terminal and len(late) < 40:
                late.append(asyncio.ensure_future(poolctl(env, "exec", ending, "--", "sh", "-c", stay)))
                await asyncio.sleep(0.15)
            await wait_state(pool.queue, ending, JobState.SUCCEEDED)
            await asyncio.gather(*late)
            assert "last" in (await log_text(pool.queue, ending)).splitlines()
            stayed = [
                p
                for p in psutil.process_iter(["cmdline", "status"])
                if p.info["cmdline"] == ["sleep", "1000"] and p.info["status"] != psutil.STATUS_ZOMBIE
            ]
            for process in stayed:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            assert not stayed, f"{len(stayed)} of {len(late)} late execs outlived their job"

            await asyncio.sleep(read_at - time.monotonic())
            go.touch()
            out_bytes, _ = await asyncio.wait_for(reading.communicate(), 30)
            assert out_bytes.split() == [str(OUTPUT_BYTES).encode(), b"0"]
        finally:  # a failed test leaves no reader waiting
            go.touch()
            if reading.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(reading.pid, signal.SIGKILL)
                await reading.wait()
    shutil.rmtree(f"/tmp/gpupool-ending-{tag}", ignore_errors=True)  # the sweep's, were it stopped
