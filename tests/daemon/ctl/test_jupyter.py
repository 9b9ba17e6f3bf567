"""Issue 49: `poolctl jupyter` queues a JupyterLab as a job of its own, forwards a local port to it
and prints its URL, end to end: a real pool server, real `poold --worker` processes running jobs
as slot uids, a real JupyterLab (the [test] extra's), and `poolctl` as a subprocess, as a
researcher runs it (test_exec.py's worker, test_forward.py's way of reading what poolctl prints).

The project poolctl runs in has no lock, so its jobs run with the worker's own Python (a worker
whose `python3` has this venv's packages, JupyterLab among them), as `--no-env` would run them:
building an environment with JupyterLab from a lock is the worker's envs.py, tested apart, and
here would cost a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import sysconfig
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from daemon.job import JobState
from daemon.queue import registry
from daemon.queue.embedded_redis import EmbeddedRedis
from storage.s3 import S3Store
from tests.daemon.ctl.test_exec import gpu_worker, log_text
from tests.support import unprivileged
from tests.support.paths import ROOT
from tests.support.pool import Pool, running_pool
from tests.support.poolctl import poolctl
from tests.support.workers import wait_state, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="slot uids need root")
URL = re.compile(r"http://127\.0\.0\.1:(\d+)/lab\?token=([\w-]+)\n")
QUEUED = re.compile(r"poolctl: (\S+) queued: ")
WHY = "waiting for 2 GPUs; reserved on "  # the server's pending reason, as `show` says it


@contextlib.contextmanager
def worker_python() -> Iterator[str]:
    """A directory holding `python3`: this interpreter's minor version, one every uid may run,
    with this venv's packages (JupyterLab among them); a worker with it first on its PATH gives its
    jobs that Python, as a worker's own Python with JupyterLab installed would."""
    place = Path(tempfile.mkdtemp(prefix="gpupool-jupyter-"))
    try:
        script = place / "python3"
        packages = sysconfig.get_paths()["purelib"]
        script.write_text(f'#!/bin/sh\nPYTHONPATH={packages} exec {unprivileged.python()} "$@"\n')
        script.chmod(0o755)
        place.chmod(0o755)
        with unprivileged.reachable():
            yield str(place)
    finally:
        shutil.rmtree(place)


@contextlib.asynccontextmanager
async def jupyter_pool(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> AsyncIterator[Pool]:
    """A pool with two workers: one serving `default`, whose Python has JupyterLab; one serving
    `bare`, whose Python (the system's) has not. Its store is theirs (the projects poolctl sends)."""
    s3 = {name.removeprefix("GPUPOOL_MAIN_SERVER_MINIO_"): value for name, value in s3_env.items()}
    store = S3Store(s3["ADDRESS"], s3["BUCKET"], s3["ACCESS_KEY_ID"], s3["SECRET_ACCESS_KEY"])
    async with running_pool(redis_server, tmp_path, store) as pool:
        with (
            worker_python() as place,
            gpu_worker(redis_server, tmp_path, s3_env, search_path=f"{place}:/usr/bin:/bin"),
            gpu_worker(redis_server, tmp_path, s3_env, "--queues", "bare", search_path="/usr/bin:/bin"),
        ):

            async def registered() -> bool:
                return len(await registry.list_workers(pool.queue.redis)) == 2

            await wait_until(registered, 30, "both workers to register")
            yield pool


@contextlib.asynccontextmanager
async def jupyter(
    env: dict[str, str], *options: str, cwd: Path = Path("/")
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`poolctl jupyter OPTIONS` running in `cwd` (killed at the end if it has not ended)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "daemon.ctl.cli", "jupyter", *options, cwd=cwd,
        env={**env, "PYTHONPATH": str(ROOT)}, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def said_until(proc: asyncio.subprocess.Process, pattern: str) -> str:
    """What poolctl has written on stderr up to the first line holding `pattern`."""
    assert proc.stderr is not None
    text = ""
    while pattern not in text:
        line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
        assert line, f"poolctl ended before saying {pattern!r}: {text}"
        text += line
    return text


async def get(port: int, target: str) -> tuple[int, bytes]:
    """GET `target` from 127.0.0.1:`port`: the status code and the body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {target} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def test_jupyter_prints_a_url_that_needs_its_token_and_ctrl_c_cancels_its_job(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    """Issue 49, `poolctl jupyter`: it queues a job of one GPU running JupyterLab in the project
    poolctl runs in, forwards a local port to it and prints `http://127.0.0.1:LOCAL/lab?token=T`;
    through it /api/status answers 200 with the token and 403 without, and the project's files
    are JupyterLab's; the token is in neither the job's command line nor its log;
    Ctrl-C ends poolctl (130), closing a connection still open through it without a word of
    asyncio's, and cancels the job. A job that still waits is said to, with the
    server's reason, and SIGTERM then cancels it (143). Where the job's Python has no JupyterLab,
    poolctl says to add it to the project's lock (exit 1) instead of waiting for ever."""
    async with jupyter_pool(redis_server, tmp_path, s3_env) as pool:
        env = pool.env("alice")
        bare = asyncio.ensure_future(poolctl(env, "jupyter", "--queue", "bare"))
        project = tmp_path / "notebooks"  # below poolctl's HOME, the pool's directory
        project.mkdir()
        (project / "pyproject.toml").write_text('[project]\nname = "notebooks"\nversion = "0.1"\n')
        (project / "analysis.py").write_text("print('hi')\n")
        async with jupyter(env, "--gpus", "1", cwd=project) as lab:
            job_id = QUEUED.search(await said_until(lab, " queued: "))[1]  # type: ignore[index]
            await wait_state(pool.queue, job_id, JobState.RUNNING, timeout=30)

            # Another needs both GPUs of the worker, one of which JupyterLab holds: it waits.
            async with jupyter(env, "--gpus", "2") as waiting:
                said = await said_until(waiting, " waits: ")
                waiting_id = QUEUED.search(said)[1]  # type: ignore[index]
                assert f"poolctl: {waiting_id} waits: {WHY}" in said, said
                waiting.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(waiting.wait(), 15) == 128 + signal.SIGTERM
                said = await said_until(waiting, "cancelled")
                assert f"job {waiting_id} cancelled: its GPUs are free" in said
                assert (await pool.queue.get(waiting_id)).state is JobState.CANCELLED

            assert lab.stdout is not None
            line = (await asyncio.wait_for(lab.stdout.readline(), 30)).decode()
            found = URL.fullmatch(line)
            assert found, line or (await lab.stderr.read()).decode()  # type: ignore[union-attr]
            local, token = int(found[1]), found[2]
            await said_until(lab, "(Ctrl-C ends it and cancels the job)")
            assert (await get(local, f"/api/status?token={token}"))[0] == 200
            assert (await get(local, "/api/status"))[0] == 403
            code, body = await get(local, f"/api/contents?token={token}")  # it serves the project
            assert code == 200
            assert {"analysis.py", "pyproject.toml"} <= {f["name"] for f in json.loads(body)["content"]}
            info = await pool.queue.get(job_id)
            assert info.state is JobState.RUNNING
            assert token not in " ".join(info.spec.argv)
            log = await log_text(pool.queue, job_id)
            assert "token=..." in log  # JupyterLab's own line, the token left out
            assert token not in log

            # A browser keeps its connections open: Ctrl-C closes them, quietly.
            held, holding = await asyncio.open_connection("127.0.0.1", local)
            request = f"GET /api/status?token={token} HTTP/1.1\r\nHost: 127.0.0.1:{local}\r\n\r\n"
            holding.write(request.encode())
            assert (await asyncio.wait_for(held.readline(), 10)).startswith(b"HTTP/1.1 200")
            lab.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(lab.wait(), 15) == 130
            said = await said_until(lab, "cancelled")
            assert said.endswith(f"poolctl: job {job_id} cancelled: its GPUs are free\n"), said
            assert "Exception" not in said
            await wait_state(pool.queue, job_id, JobState.CANCELLED, timeout=10)
            holding.close()

        code, out, err = await bare
        assert (code, out) == (1, ""), err
        assert "its environment has no JupyterLab" in err
        assert "add `jupyterlab` to the project's lock" in err
        bare_id = QUEUED.search(err)[1]  # type: ignore[index]
        assert (await pool.queue.get(bare_id)).state.terminal
