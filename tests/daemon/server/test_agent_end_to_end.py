"""An agent worker end to end (issue 44 item 1): the real agent (daemon/worker/agent.py), holding
only alice's token, on a real server that runs its worker (daemon/worker/hosted.py), with a real
Redis and a real S3, running real processes: a job with its data, saves and artifacts, and a
project sent by poolctl from its directory, run in the environment built from its lock."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from daemon.job import JobSpec
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.worker import agent
from daemon.worker.envs import NO_INDEX, EnvSettings
from daemon.worker.hosted import hosted_worker
from protocol import Waited, WaitJobs
from storage.content import content_key
from storage.s3 import S3Store
from tests.support.pool import Pool, running_pool
from tests.support.poolctl import poolctl
from tests.support.s3server import S3Server
from tests.support.wheels import locked_project, make_wheel

LEASE = 2.0
SAVE_THEN_FAIL = (
    'cat "$GPUPOOL_CHECKPOINT_DIR/step" 2>/dev/null; echo 1 > "$GPUPOOL_CHECKPOINT_DIR/step"; exit 3'
)


@pytest.fixture
async def s3_pool(redis_server: EmbeddedRedis, tmp_path: Path, s3_server: S3Server) -> AsyncIterator[Pool]:
    store = S3Store(
        s3_server.endpoint.removeprefix("http://"),
        f"e-{secrets.token_hex(6)}",
        s3_server.access_key,
        s3_server.secret_key,
    )
    async with store:
        await store.ensure_bucket()
    async with running_pool(
        redis_server,
        tmp_path,
        store=store,
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
