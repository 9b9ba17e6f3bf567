"""Issue 49: `poolctl exec JOB -- CMD` runs a command inside a running job's allocation, end to end:
a real pool server, a real `poold --worker` process with made-up GPUs (tests/support/nvml_seam)
running jobs as slot uids, and `poolctl` as a subprocess, as a researcher runs it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import psutil

from daemon.job import JobSpec, JobState
from daemon.queue import registry
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from tests.support.paths import ROOT
from tests.support.pool import Pool, running_pool
from tests.support.poolctl import poolctl
from tests.support.processes import terminate
from tests.support.workers import wait_state, wait_until

NVML_SEAM = ROOT / "tests" / "support" / "nvml_seam"
# What the job prints of itself, then it waits to be looked into.
JOB = 'echo "$CUDA_VISIBLE_DEVICES $GPUPOOL_JOB_ID"; id -u; pwd; echo ready; exec sleep 60'
LOOK = 'echo "$CUDA_VISIBLE_DEVICES $GPUPOOL_JOB_ID"; id -u; pwd'


@contextlib.contextmanager
def gpu_worker(
    redis_server: EmbeddedRedis,
    log_to: Path,
    s3_env: dict[str, str],
    *options: str,
    search_path: str | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """A `poold --worker` with two made-up GPUs (and `options`), its process; as root, its jobs run
    as uids it leases. Its data is in /tmp, passable by those uids (pytest's own directories are
    root's, 0700). `search_path`: its PATH, and so its jobs' (None: this process's)."""
    data_dir = Path(tempfile.mkdtemp(prefix="gpupool-exec-"))
    data_dir.chmod(0o711)
    argv = [
        sys.executable, "-m", "daemon.main", "--worker", "--worker-mode", "multinode",
        "--redis-port", str(redis_server.port), "--metrics-listen", "127.0.0.1:0",
        "--data-dir", str(data_dir), "--heartbeat-interval", "0.5", "--kill-grace", "1",
        "--drain-timeout", "0", "--worker-remote-processors", "2", *options,
    ]  # fmt: skip
    path = os.pathsep.join([str(NVML_SEAM), str(ROOT)])
    env = dict(
        os.environ,
        GPUPOOL_MAIN_SERVER_REDIS_PASSWORD=redis_server.password,
        PYTHONPATH=path,
        FAKE_NVML_GPUS="16,16",
        FAKE_NVML_HOST=secrets.token_hex(3),
        **s3_env,
    )
    if search_path is not None:
        env["PATH"] = search_path
    data_dir.mkdir(parents=True, exist_ok=True)
    with (
        open(data_dir.parent / "worker.log", "wb") as log,
        subprocess.Popen(argv, env=env, stderr=log) as proc,
    ):
        try:
            yield proc
        finally:
            terminate(proc, 30)


@asynccontextmanager
async def running_job(
    redis_server: EmbeddedRedis,
    tmp_path: Path,
    s3_env: dict[str, str],
    *,
    command: str = JOB,
    ready_line: str = "ready",
    worker_options: tuple[str, ...] = (),
) -> AsyncIterator[tuple[Pool, str, list[str]]]:
    """A pool, its GPU worker, and alice's job of one GPU running there (`sh -c COMMAND`, ready
    once its log has a line starting `ready_line`); with the job's first three lines (JOB's: its
    CUDA_VISIBLE_DEVICES and id, uid, directory)."""
    async with running_pool(redis_server, tmp_path) as pool:
        with gpu_worker(redis_server, tmp_path / "worker.log", s3_env, *worker_options):
            queue = pool.queue

            async def registered() -> bool:
                return len(await registry.list_workers(queue.redis)) == 1

            await wait_until(registered, 30, "the worker to register")
            job_id, _ = await queue.enqueue(JobSpec(argv=("sh", "-c", command), gpus=1, user="alice"))
            said: list[str] = []

            async def ready() -> bool:
                said[:] = b"".join(d for _, d in await queue.read_log(job_id)).decode().splitlines()
                return any(line.startswith(ready_line) for line in said)

            await wait_until(ready, 30, "the job to start")
            yield pool, job_id, said[:3]


async def log_text(queue: JobQueue, job_id: str) -> str:
    return b"".join(d for _, d in await queue.read_log(job_id)).decode()


async def test_exec_runs_in_the_jobs_allocation_with_stdin_and_its_exit_code_and_only_for_its_owner(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    """Issue 49, `exec` done-when: a command run with `poolctl exec` inside a running job sees the
    job's GPUs (CUDA_VISIBLE_DEVICES), its environment (GPUPOOL_JOB_ID), its uid (a slot's, not
    the worker's root) and its working directory; piped stdin reaches it and its end closes it;
    poolctl exits with its exit code, with stdout and stderr apart; bob is refused with a sentence
    and exit code 6, and nothing of his runs; every exec is in the job's log."""
    async with running_job(redis_server, tmp_path, s3_env) as (pool, job_id, said):
        gpus_and_id, uid, cwd = said
        gpus, job = gpus_and_id.split()  # its GPU was given, and its id
        assert (gpus, job) == (gpus, job_id)
        assert uid != "0"  # the job runs as a slot's uid
        env = pool.env("alice")

        code, out, err = await poolctl(env, "exec", job_id, "--", "sh", "-c", LOOK)
        assert (code, err) == (0, "")
        assert out.splitlines() == [gpus_and_id, uid, cwd]

        code, out, err = await poolctl(env, "exec", job_id, "--", "cat", stdin=b"hi\nthere\n")
        assert (code, out, err) == (0, "hi\nthere\n", "")

        code, out, err = await poolctl(
            env, "exec", job_id, "--", "sh", "-c", "echo out; echo err >&2; exit 7"
        )
        assert (code, out, err) == (7, "out\n", "err\n")

        marker = Path("/tmp") / f"gpupool-exec-{secrets.token_hex(6)}"
        code, out, err = await poolctl(pool.env("bob"), "exec", job_id, "--", "touch", str(marker))
        assert code == 6
        assert (
            err == f"poolctl: job {job_id} belongs to alice: only its owner or a pool admin may exec in it\n"
        )
        code, _, err = await poolctl(env, "exec", "default.nosuchjob", "--", "true")
        assert code == 5, err
        await asyncio.sleep(0.3)  # were anything of bob's started, its file would be there by now
        assert not marker.exists()
        text = await log_text(pool.queue, job_id)
        assert text.count("[gpupool] exec by alice") == 3, text
        assert "bob" not in text


def tagged(tag: str, uid: str) -> list[dict[str, object]]:
    """The processes of a command tagged `tag` (its sh, its `sleep 600` of the job's `uid`); one
    that ends while they are listed is left out (psutil skips it)."""
    return [
        p.info
        for p in psutil.process_iter(["cmdline", "uids"])
        if tag in " ".join(p.info["cmdline"] or [])
        or (p.info["cmdline"] == ["sleep", "600"] and str(getattr(p.info["uids"], "real", "")) == uid)
    ]


async def test_an_exec_ends_when_its_client_goes_away_and_when_its_job_ends(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    """Issue 49, `exec` done-when: a command running inside a job is killed when its `poolctl`
    goes away (killed: the server sees the connection end), the job running on; and when the job
    ends (here cancelled), when `poolctl exec` returns at once, saying so, with the exit status of
    a command killed by SIGKILL (137). A job not running any more is refused."""
    async with running_job(redis_server, tmp_path, s3_env) as (pool, job_id, said):
        env = pool.env("alice")

        async def started(tag: str) -> None:
            async def seen() -> bool:
                return tag in await log_text(pool.queue, job_id)

            await wait_until(seen, 30, "the exec to start")

        tag = secrets.token_hex(6)
        command = f"sleep 600; : {tag}"  # sh stays, its command line tagged; sleep is its child
        gone = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "daemon.ctl.cli", "exec", job_id, "--", "sh", "-c", command,
            env={**env, "PYTHONPATH": str(ROOT)}, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        await started(tag)
        assert tagged(tag, said[1])
        gone.kill()
        await gone.wait()

        async def killed() -> bool:
            return not tagged(tag, said[1])

        await wait_until(killed, 10, "the command of a client gone to be killed")
        assert (await pool.queue.get(job_id)).state is JobState.RUNNING

        tag = secrets.token_hex(6)
        command = f"sleep 600; : {tag}"
        execing = asyncio.ensure_future(poolctl(env, "exec", job_id, "--", "sh", "-c", command))
        await started(tag)
        await pool.queue.cancel(job_id)
        began = time.monotonic()
        code, _, err = await asyncio.wait_for(execing, 30)
        assert time.monotonic() - began < 10
        assert code == 137, err
        assert err == f"poolctl: sh in {job_id}: killed by SIGKILL (the job ended)\n"
        await wait_state(pool.queue, job_id, JobState.CANCELLED)
        assert not tagged(tag, said[1])

        code, _, err = await poolctl(env, "exec", job_id, "--", "true")
        assert code == 2
        assert (
            err
            == f"poolctl: job {job_id} is cancelled, not running: exec runs a command inside a running job\n"
        )


async def test_exec_into_a_queued_job_or_an_agents_is_refused_in_a_sentence(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """Issue 49, `exec`'s refusals: a job not running yet, and one running on an agent's machine
    (which the server reaches only through the agent's own connection: not supported yet), each
    get a sentence saying so and exit status 2, and nothing is sent to any worker. A pool admin
    passes the owner's check (and meets the same refusals); bob does not (exit 6)."""
    users = ("alice", "bob", "carol")
    async with running_pool(redis_server, tmp_path, users=users, admins=("carol",)) as pool:
        queued, _ = await pool.queue.enqueue(JobSpec(argv=("true",), user="alice"))
        not_running = f"job {queued} is queued, not running: exec runs a command inside a running job"
        for user in ("alice", "carol"):
            said = await poolctl(pool.env(user), "exec", queued, "--", "true")
            assert said == (2, "", f"poolctl: {not_running}\n")
        code, _, _ = await poolctl(pool.env("bob"), "exec", queued, "--", "true")
        assert code == 6
        agent = registry.agent_worker_id("laptop")
        lease = await pool.queue.claim(agent, ["default"])
        assert lease is not None
        assert lease.job_id == queued
        code, _, err = await poolctl(pool.env("alice"), "exec", queued, "--", "true")
        assert code == 2
        assert err == (
            f"poolctl: job {queued} runs on an agent's machine ({agent}), where exec is not supported yet; "
            "run the command from the job itself\n"
        )
