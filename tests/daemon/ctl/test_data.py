"""Data in jobs, end to end: `poolctl put`, `enqueue --input/--snapshot`, artifacts and `poolctl get`,
against the real S3 endpoint and the local store (fixture params), with an in-process worker."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import orjson
import pytest

from daemon.config import load
from daemon.errors import GpupoolError, InvalidJob, StaleAttempt
from daemon.job import JobSpec, JobState, Outcome
from daemon.object_store import artifact_prefix, open_worker_store
from daemon.queue import keys
from daemon.queue.claims import Capacity
from daemon.queue.job_queue import JobQueue
from daemon.worker.dispatcher import Worker
from daemon.worker.job_data import upload_artifacts
from storage.base import ObjectStore
from storage.local import LocalStore
from storage.s3 import S3Store
from tests.support.pool import Pool, running_pool
from tests.support.poolctl import poolctl
from tests.support.workers import running_worker, wait_state


@pytest.fixture(params=["s3", "local"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    """A store for the pool (opened and closed by the server)."""
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    s3 = request.getfixturevalue("s3_server")
    store = S3Store(s3.endpoint, f"d-{secrets.token_hex(6)}", s3.access_key, s3.secret_key)
    async with store:
        await store.ensure_bucket()
    return store


@pytest.fixture
async def data_pool(redis_server: object, tmp_path: Path, store: ObjectStore) -> AsyncIterator[Pool]:
    async with running_pool(redis_server, tmp_path, store=store) as p:  # type: ignore[arg-type]
        yield p


def worker(pool: Pool, tmp: Path) -> AbstractAsyncContextManager[Worker]:
    return running_worker(pool.queue, tmp / "w", store=pool.server.store, slots=2)


async def ok(env: dict[str, str], *args: str, cwd: Path | None = None) -> str:
    code, out, err = await poolctl(env, *args, cwd=cwd)
    assert code == 0, err
    return out


async def test_dataset_put_once_is_downloaded_once_for_two_jobs_and_artifacts_come_back(
    data_pool: Pool, tmp_path: Path
) -> None:
    env = data_pool.env()
    data = os.urandom(300_000)
    (tmp_path / "data.bin").write_bytes(data)
    out = await ok(env, "put", str(tmp_path / "data.bin"), "--name", "ds1")
    assert out.startswith("ds1\tsha256:")
    assert "(already stored)" not in out
    assert "(already stored)" in await ok(env, "put", str(tmp_path / "data.bin"), "--name", "ds1")
    again = orjson.loads(await ok(env, "put", str(tmp_path / "data.bin"), "--name", "ds1", "--json"))
    assert (again["name"], again["size"], again["kind"], again["sent"]) == ("ds1", 300_000, "file", False)

    script = 'O="$GPUPOOL_OUTPUT"; cat in/data.bin > "$O/copy"; mkdir "$O/sub"; echo hi > "$O/sub/x"'
    jobs = [
        (await ok(env, "enqueue", "--input", "ds1:in/data.bin", "--", "sh", "-c", script)).strip()
        for _ in range(2)
    ]
    async with worker(data_pool, tmp_path) as w:
        for job_id in jobs:
            info = await wait_state(data_pool.queue, job_id, JobState.SUCCEEDED, JobState.FAILED)
            assert info.state is JobState.SUCCEEDED, info.detail
        assert w.cache is not None
        assert w.cache.downloads == 1  # the second job was a cache hit (or shared the download)

    dest = tmp_path / "got"
    out = await ok(env, "get", jobs[1], str(dest))
    assert (dest / "copy").read_bytes() == data
    assert (dest / "sub" / "x").read_text() == "hi\n"
    assert (dest / f"{jobs[1]}.log").exists()
    assert str(dest / "copy") in out
    listed = [
        orjson.loads(line)
        for line in (await ok(env, "get", jobs[1], str(tmp_path / "j"), "--json")).splitlines()
    ]
    assert {"path": str(tmp_path / "j" / "copy"), "size": 300_000} in listed

    shown = await ok(env, "show", jobs[1])
    assert "artifacts:" in shown
    assert "293.0 KiB  copy" in shown  # 300000 bytes, with its size
    assert "in/data.bin (file" in shown


async def test_local_inputs_reach_the_job_at_dest(data_pool: Pool, tmp_path: Path) -> None:
    env = data_pool.env()
    tree = tmp_path / "mydir"
    (tree / "nested").mkdir(parents=True)
    (tree / "nested" / "a.txt").write_text("from a dir\n")
    (tmp_path / "one.txt").write_text("a file\n")
    script = 'cat data/x/nested/a.txt one.txt > "$GPUPOOL_OUTPUT/seen"'
    job_id = (
        await ok(
            env,
            "enqueue",
            "--input",
            f"{tree}:data/x",
            "--input",
            str(tmp_path / "one.txt"),
            "--",
            "sh",
            "-c",
            script,
        )
    ).strip()
    async with worker(data_pool, tmp_path):
        info = await wait_state(data_pool.queue, job_id, JobState.SUCCEEDED, JobState.FAILED)
    assert info.state is JobState.SUCCEEDED, info.detail
    await ok(env, "get", job_id, str(tmp_path / "got"))
    assert (tmp_path / "got" / "seen").read_text() == "from a dir\na file\n"


async def test_the_log_is_archived_when_there_is_one(data_pool: Pool, tmp_path: Path) -> None:
    silent, _ = await data_pool.queue.enqueue(JobSpec(argv=("true",), user="alice"))
    loud, _ = await data_pool.queue.enqueue(JobSpec(argv=("echo", "hello"), user="alice"))
    async with worker(data_pool, tmp_path):
        quiet = await wait_state(data_pool.queue, silent, JobState.SUCCEEDED, JobState.FAILED)
        said = await wait_state(data_pool.queue, loud, JobState.SUCCEEDED, JobState.FAILED)
    assert "log" not in quiet.result  # nothing to archive, and no object for it
    assert quiet.result["artifacts"] == []
    assert said.result["log"]["size"] == len(b"hello\n")
    await ok(data_pool.env(), "get", loud, str(tmp_path / "got"))
    assert (tmp_path / "got" / f"{loud}.log").read_bytes() == b"hello\n"


def git(repo: Path, *argv: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *argv], cwd=repo, check=True, capture_output=True
    )


async def test_snapshot_of_a_dirty_tree_runs_the_uncommitted_change(data_pool: Pool, tmp_path: Path) -> None:
    env = data_pool.env()
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "msg.txt").write_text("committed\n")
    (repo / ".gitignore").write_text("secret.txt\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "one")
    (repo / "msg.txt").write_text("modified\n")
    (repo / "new.txt").write_text("untracked\n")
    (repo / "secret.txt").write_text("ignored\n")
    script = 'cat msg.txt new.txt > "$GPUPOOL_OUTPUT/seen"; ls -A > "$GPUPOOL_OUTPUT/ls"'
    job_id = (await ok(env, "enqueue", "--snapshot", "--", "sh", "-c", script, cwd=repo)).strip()
    (repo / "msg.txt").write_text("edited after enqueue\n")  # must change nothing

    shown = await ok(env, "show", job_id)
    assert "+ uncommitted changes" in shown
    async with worker(data_pool, tmp_path):
        info = await wait_state(data_pool.queue, job_id, JobState.SUCCEEDED, JobState.FAILED)
    assert info.state is JobState.SUCCEEDED, info.detail
    await ok(env, "get", job_id, str(tmp_path / "got"))
    assert (tmp_path / "got" / "seen").read_text() == "modified\nuntracked\n"
    assert (tmp_path / "got" / "ls").read_text().split() == [".gitignore", "msg.txt", "new.txt"]

    code, _, err = await poolctl(env, "enqueue", "--snapshot", "--git", "--", "true", cwd=repo)
    assert code == 2
    assert "job project: cannot be combined with git: the job runs in its project" in err


async def test_a_zombie_attempts_artifacts_cannot_replace_the_committed_ones(
    data_pool: Pool, tmp_path: Path
) -> None:
    queue: JobQueue = data_pool.queue
    store = data_pool.server.store
    job_id, _ = await queue.enqueue(JobSpec(argv=("true",), user="alice"))
    zombie = await queue.claim("w-zombie", ["default"], Capacity(0))
    assert zombie is not None
    await queue.redis.zadd(keys.leases("default"), {job_id: 0})  # its lease ran out: reclaimed
    await queue.reclaim()
    current = await queue.claim("w-new", ["default"], Capacity(0))
    assert current is not None
    assert current.attempt == 2

    for lease, text in ((current, "good"), (zombie, "zombie")):
        out = tmp_path / f"out{lease.attempt}"
        out.mkdir()
        (out / "model.pt").write_text(text)
        result = await upload_artifacts(store, queue, lease, out)
        if lease is current:
            await queue.complete(lease, Outcome(JobState.SUCCEEDED, 0, "", result))
        else:
            with pytest.raises(StaleAttempt):
                await queue.complete(lease, Outcome(JobState.FAILED, 1, "", result))

    await ok(data_pool.env(), "get", job_id, str(tmp_path / "got"))
    assert (tmp_path / "got" / "model.pt").read_text() == "good"
    stored = [o.key for o in await store.list(f"artifacts/{job_id}/")]
    assert artifact_prefix(job_id, zombie.id) + "out/model.pt" in stored  # under its own lease only


async def finished_with(
    data_pool: Pool, tmp_path: Path, forge: Callable[[dict[str, Any]], dict[str, Any]]
) -> str:
    """A job of alice's that uploaded model.pt and ended with the result `forge` makes of what it
    uploaded (what a forged record would hold)."""
    queue: JobQueue = data_pool.queue
    job_id, _ = await queue.enqueue(JobSpec(argv=("true",), user="alice"))
    lease = await queue.claim("w1", ["default"], Capacity(0))
    assert lease is not None
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.pt").write_text("weights")
    uploaded = await upload_artifacts(data_pool.server.store, queue, lease, out)
    await queue.complete(lease, Outcome(JobState.SUCCEEDED, 0, "", {**uploaded, **forge(uploaded)}))
    return job_id


@pytest.mark.parametrize("name", ["../../escaped.txt", "/tmp/absolute.txt", "a/../../b"])
async def test_get_refuses_an_artifact_named_outside_dest_and_writes_nothing(
    data_pool: Pool, tmp_path: Path, name: str
) -> None:
    def forged(uploaded: dict[str, Any]) -> dict[str, Any]:
        good = uploaded["artifacts"][0]
        return {"artifacts": [good, {**good, "name": name}]}

    job_id = await finished_with(data_pool, tmp_path, forged)
    code, _, err = await poolctl(data_pool.env(), "get", job_id, str(tmp_path / "got" / "here"))
    assert code == 1
    assert f"{name!r}" in err
    assert "outside" in err
    assert not (tmp_path / "got").exists()  # refused before anything was fetched
    assert not (tmp_path / "escaped.txt").exists()


async def test_get_refuses_an_artifact_that_is_not_what_the_job_recorded(
    data_pool: Pool, tmp_path: Path
) -> None:
    def tampered(uploaded: dict[str, Any]) -> dict[str, Any]:
        good = uploaded["artifacts"][0]
        return {"artifacts": [{**good, "sha256": "0" * 64}]}

    job_id = await finished_with(data_pool, tmp_path, tampered)
    code, _, err = await poolctl(data_pool.env(), "get", job_id, str(tmp_path / "got"))
    assert code == 1
    assert "recorded" in err
    assert "0" * 12 in err
    assert not (tmp_path / "got" / "model.pt").exists()


async def test_a_worker_without_its_bucket_fails_with_the_endpoint_and_bucket(tmp_path: Path) -> None:
    from daemon.queue.embedded_redis import free_port

    config = load(
        None,
        env={
            "GPUPOOL_WORKER_MODE": "multinode",
            "GPUPOOL_MAIN_SERVER_MINIO_ADDRESS": f"127.0.0.1:{free_port()}",
            "GPUPOOL_MAIN_SERVER_MINIO_BUCKET": "nowhere",
            "GPUPOOL_MAIN_SERVER_MINIO_BUCKET_PING_TIMEOUT": "0.5",
        },
        config_file=None,
    )
    with pytest.raises(GpupoolError) as err:
        await open_worker_store(config)
    assert "nowhere" in str(err.value)
    assert config.main_server_minio_address in str(err.value)


def test_spec_inputs_and_snapshot_are_validated() -> None:
    sha = "ab" * 32
    spec = JobSpec.from_dict({"argv": ["x"], "inputs": [{"sha256": sha, "dest": "d/f", "kind": "file"}]})
    assert spec.to_dict()["inputs"] == [{"sha256": sha, "dest": "d/f", "kind": "file"}]
    for bad in ("../up", "/abs", "a//b", "."):
        with pytest.raises(InvalidJob, match="dest"):
            JobSpec.from_dict({"argv": ["x"], "inputs": [{"sha256": sha, "dest": bad, "kind": "file"}]})
    with pytest.raises(InvalidJob, match="kind"):
        JobSpec.from_dict({"argv": ["x"], "inputs": [{"sha256": sha, "dest": "a", "kind": "blob"}]})
    snap = {"sha256": sha, "commit": "", "dirty": True}
    with pytest.raises(InvalidJob, match="snapshot"):
        JobSpec.from_dict({"argv": ["x"], "snapshot": snap, "git": {"repo": "r", "ref": "main"}})
    with pytest.raises(InvalidJob, match="cwd"):
        JobSpec.from_dict(
            {"argv": ["x"], "cwd": "/tmp", "inputs": [{"sha256": sha, "dest": "a", "kind": "dir"}]}
        )
