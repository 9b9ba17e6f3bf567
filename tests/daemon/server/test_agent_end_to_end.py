"""An agent worker end to end (issue 44 item 1): the real agent (daemon/worker/agent.py), holding
only alice's token, on a real server that runs its worker (daemon/worker/hosted.py), with a real
Redis and a real S3, running real processes: a job with its data, saves and artifacts, and a
project sent by poolctl from its directory, run in the environment built from its lock; and, as a
`poold --worker` process, its liveness both ways: frozen, its job runs elsewhere; its server
frozen, it kills its job and leaves."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest

from daemon.job import JobSpec, JobState
from daemon.queue import registry
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.worker import agent
from daemon.worker.env_build import NO_INDEX, EnvSettings
from daemon.worker.hosted import hosted_worker
from protocol import Waited, WaitJobs
from storage.content import content_key
from tests.daemon.server.test_agents import ScriptedAgent, wait_for
from tests.support.paths import ROOT
from tests.support.pool import Pool, fresh_bucket, running_pool
from tests.support.poolctl import poolctl
from tests.support.s3server import S3Server
from tests.support.wheels import locked_project, make_wheel
from tests.support.workers import JOBS_AS_ROOT, sh, wait_until

LEASE = 2.0
SAVE_THEN_FAIL = (
    'cat "$GPUPOOL_CHECKPOINT_DIR/step" 2>/dev/null; echo 1 > "$GPUPOOL_CHECKPOINT_DIR/step"; exit 3'
)


@pytest.fixture
async def s3_pool(redis_server: EmbeddedRedis, tmp_path: Path, s3_server: S3Server) -> AsyncIterator[Pool]:
    async with running_pool(
        redis_server,
        tmp_path,
        store=await fresh_bucket(s3_server),
        agent_workers=hosted_worker,
        worker_healthy_response_period=LEASE,
        retry_backoff=LEASE + 1.0,  # the agent hears nothing from the server meanwhile
    ) as p:
        yield p


async def test_an_agent_runs_alices_jobs_with_their_data_saves_and_artifacts(
    s3_pool: Pool, tmp_path: Path
) -> None:
    """issue 44 item 1: an agent holding only alice's token runs her job with its input (fetched
    through a URL the server signed), its output recorded in the log and uploaded as an artifact
    under the attempt's own prefix; and a job that fails with a retry saves its checkpoint, which
    its second attempt, run by the agent after a pause longer than a lease, restores."""
    data = b"alice's dataset\n"
    sha = hashlib.sha256(data).hexdigest()
    await s3_pool.server.store.put_bytes(content_key(sha), data)
    inputs = [{"sha256": sha, "dest": "d", "kind": "file"}]
    train = 'cat d; echo w > "$GPUPOOL_OUTPUT/model.txt"'
    job_id, _ = await s3_pool.queue.enqueue(
        JobSpec.from_dict({"argv": ["sh", "-c", train], "user": "alice", "inputs": inputs})
    )
    resumed, _ = await s3_pool.queue.enqueue(
        JobSpec.from_dict({"argv": ["sh", "-c", SAVE_THEN_FAIL], "user": "alice", "retries": 1})
    )
    worker = agent.Agent(
        s3_pool.client("alice"), data_dir=tmp_path / "agent", slots=1, gpus=[], drain_timeout=1.0
    )
    await worker.start()
    try:
        async with s3_pool.client("alice") as alice:
            waited = await alice.call(WaitJobs([job_id, resumed], 20.0), Waited)
    finally:
        await worker.stop()
    trained, retried = waited.jobs
    assert trained["state"] == "succeeded", trained
    [artifact] = trained["result"]["artifacts"]
    assert artifact["key"].startswith(f"artifacts/{job_id}/{worker.worker_id}%2F")
    assert await s3_pool.server.store.get_bytes(artifact["key"]) == b"w\n"
    assert b"alice's dataset" in b"".join(d for _, d in await s3_pool.queue.read_log(job_id))
    assert [a["how"] for a in retried["attempts"]] == ["failed", "failed"], retried
    log = b"".join(d for _, d in await s3_pool.queue.read_log(resumed))
    assert b"restored into $GPUPOOL_CHECKPOINT_DIR" in log
    assert log.count(b"\n1\n") == 1  # the second attempt read the first's save


async def test_an_agent_runs_a_project_from_its_directory_in_its_locked_environment(
    s3_pool: Pool, tmp_path: Path
) -> None:
    """issue 44 item 1 with issue 45: alice's project, sent by poolctl from its directory as packs,
    runs on her agent, which fetches the packs on URLs the server signs for the attempt, and in
    the environment the agent builds from the project's lock (a local wheelhouse, no index)."""
    wheelhouse = tmp_path / "wheels"
    make_wheel(wheelhouse, "tinypkg", "1.3")
    project = locked_project(tmp_path / "myproject", wheelhouse, "tinypkg==1.3")
    (project / "train.py").write_text("import tinypkg\nprint('trained with tinypkg', tinypkg.VERSION)\n")
    settings = EnvSettings(index_url=NO_INDEX, find_links=(str(wheelhouse),))
    worker = agent.Agent(
        s3_pool.client("alice"),
        data_dir=tmp_path / "agent",
        slots=1,
        gpus=[],
        drain_timeout=1.0,
        env_settings=settings,
    )
    await worker.start()
    try:
        code, out, err = await poolctl(
            s3_pool.env(), "enqueue", "-f", "--", "python", "train.py", cwd=project
        )
    finally:
        await worker.stop()
    assert code == 0, err
    assert "trained with tinypkg 1.3" in out


@pytest.fixture
async def pool(redis_server: EmbeddedRedis, tmp_path: Path) -> AsyncIterator[Pool]:
    (tmp_path / "pool").mkdir()
    async with running_pool(
        redis_server,
        tmp_path / "pool",
        users=("alice", "root"),
        admins=("root",),
        agent_workers=hosted_worker,
        worker_healthy_response_period=LEASE,
    ) as p:
        yield p


@pytest.fixture
def agent_process(pool: Pool, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`poold --worker` through the pool's server, as alice, one slot; its log in tmp/agent.log."""
    token = tmp_path / "token"
    token.write_text(pool.tokens["alice"] + "\n")
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")} | JOBS_AS_ROOT
    env |= {
        "GPUPOOL_WORKER_VIA_SERVER": pool.address,
        "GPUPOOL_WORKER_SERVE_USER": "alice",
        "GPUPOOL_WORKER_TOKEN_FILE": str(token),
        "GPUPOOL_WORKER_REMOTE_PROCESSORS": "1",
        "GPUPOOL_DATA_DIR": str(tmp_path / "agent"),
        "GPUPOOL_METRICS_LISTEN": "127.0.0.1:0",
    }
    with (tmp_path / "agent.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "daemon.main", "--worker"], env=env, cwd=ROOT, stderr=log
        )
    try:
        yield process
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait(10)


async def job_started(pool: Pool, tmp_path: Path) -> tuple[str, int]:
    """A job of alice's that sleeps, once it runs: its id and its process's pid."""
    pid_file = tmp_path / "pid"
    job_id, _ = await pool.queue.enqueue(sh(f"echo $$ > {pid_file}; exec sleep 60", user="alice"))

    async def started() -> bool:
        return pid_file.exists() and pid_file.read_text().strip() != ""

    await wait_until(started, 30, "the agent to start the job")
    return job_id, int(pid_file.read_text())


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def test_a_frozen_agents_job_is_reclaimed_and_runs_elsewhere(
    pool: Pool, agent_process: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    """issue 44 item 1: the real agent, SIGSTOPped while its job runs (its connection stays up:
    the kernel keeps TCP): its beats stop, so its worker on the server is abandoned and leaves
    the registry, the lease lapses, and the job runs again, attempt 2, on another agent; the
    frozen agent's orphan guard has killed its job by then."""
    job_id, pid = await job_started(pool, tmp_path)
    [frozen] = [w["id"] for w in await registry.list_workers(pool.queue.redis)]
    agent_process.send_signal(signal.SIGSTOP)
    async with ScriptedAgent(pool, "alice", host="node-b") as second:
        again = await second.next("run")
        assert again.detail["lease"]["job_id"] == job_id
        assert again.detail["lease"]["attempt"] == 2
        assert not alive(pid)  # killed at its deadline, before the lease could pass to another
        assert frozen not in {w["id"] for w in await registry.list_workers(pool.queue.redis)}
        await second.run_to_success(again)
        job = await wait_for(pool, job_id)
    assert job["state"] == JobState.SUCCEEDED
    assert [a["how"] for a in job["attempts"]] == ["lost", "succeeded"]


async def test_an_agent_whose_server_stops_answering_kills_its_job_and_leaves(
    pool: Pool, agent_process: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    """issue 44 item 1: the server stops answering the real agent's beats (here, its event loop
    frozen: this test's), while the connection stays up: within the lease the agent's self-fence
    kills its job, and with no beat answered for a lease it ends its serve and exits, saying why."""
    _, pid = await job_started(pool, tmp_path)
    time.sleep(LEASE + 0.5)  # the server, in this process, answers nothing meanwhile
    assert not alive(pid)
    assert await asyncio.to_thread(agent_process.wait, 15) is not None
    assert "no beat answered by the pool server" in (tmp_path / "agent.log").read_text()
