"""A job runs in a copy of the project poolctl runs in, by default (issue 45 item 1): real poolctl
processes, a real server and store, an in-process worker running the job."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from daemon.client.pool_client import ClientError
from daemon.errors import InvalidJob
from daemon.job import JobSpec, JobState
from daemon.spec_checks import project_id
from protocol import CheckObjects, Enqueue, Enqueued, ErrorCode, JobDetail, ObjectsHeld, ShowJob
from storage.base import ObjectStore
from storage.local import LocalStore
from storage.s3 import S3Store
from tests.support.paths import ROOT
from tests.support.pool import Pool, running_pool
from tests.support.poolctl import poolctl
from tests.support.workers import running_worker, wait_state


@pytest.fixture
async def data_pool(redis_server: object, tmp_path: Path) -> AsyncIterator[Pool]:
    async with running_pool(redis_server, tmp_path, store=LocalStore(tmp_path / "store")) as p:  # type: ignore[arg-type]
        yield p


@pytest.fixture(params=["local", "s3"])
async def either_pool(
    request: pytest.FixtureRequest, redis_server: object, tmp_path: Path
) -> AsyncIterator[Pool]:
    """A pool on each kind of store: on S3, whether a pack is held is the user's owner record."""
    store: ObjectStore = LocalStore(tmp_path / "store")
    if request.param == "s3":
        s3 = request.getfixturevalue("s3_server")
        store = S3Store(s3.endpoint, f"p-{secrets.token_hex(6)}", s3.access_key, s3.secret_key)
        async with store:
            await store.ensure_bucket()
    async with running_pool(redis_server, tmp_path, store=store) as p:  # type: ignore[arg-type]
        yield p


def project_env(pool: Pool, tmp: Path, **extra: str) -> dict[str, str]:
    """poolctl's environment as a researcher's: a home of its own above the project, and a cache."""
    return pool.env("alice", XDG_CACHE_HOME=str(tmp / "cache"), **extra)


async def enqueue(env: dict[str, str], cwd: Path, *argv: str) -> str:
    code, out, err = await poolctl(env, "enqueue", "--", *argv, cwd=cwd)
    assert code == 0, err
    return out.strip()


async def run(pool: Pool, tmp: Path, job_id: str) -> str:
    """Run the queued job on a worker; its log."""
    async with running_worker(pool.queue, tmp / "w", store=pool.server.store, slots=1):
        info = await wait_state(pool.queue, job_id, JobState.SUCCEEDED, JobState.FAILED)
    log = b"".join(data for _, data in await pool.queue.read_log(job_id, "0-0", count=1000)).decode()
    assert info.state is JobState.SUCCEEDED, info.detail + log
    return log


async def stored(store: ObjectStore) -> set[str]:
    return {o.key for o in await store.list("sha256/")}


def git(repo: Path, *argv: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *argv], cwd=repo, check=True, capture_output=True
    )


async def test_the_readmes_first_example_finds_train_py_in_a_project(data_pool: Pool, tmp_path: Path) -> None:
    """issue 45 item 1: `cd myproject && poolctl enqueue -- python train.py` runs train.py, in the
    same place within the copy as poolctl ran in the project (or as --workdir names); `show` names
    the snapshot."""
    project = tmp_path / "myproject"
    (project / "src").mkdir(parents=True)
    (project / "pyproject.toml").write_text("[tool.ruff]\nline-length = 100\n")  # a marker, no [project]
    (project / "train.py").write_text("print('training', open('src/data.txt').read().strip())\n")
    (project / "src" / "data.txt").write_text("from the laptop\n")
    env = project_env(data_pool, tmp_path)
    job_id = await enqueue(env, project, "python", "train.py")
    log = await run(data_pool, tmp_path, job_id)
    assert "training from the laptop" in log

    deeper = await enqueue(env, project / "src", "cat", "data.txt")  # started where poolctl ran
    assert "from the laptop" in await run(data_pool, tmp_path, deeper)
    named = ("--workdir", str(project / "src"))  # from elsewhere: the same project, the same place
    code, out, err = await poolctl(env, "enqueue", *named, "--", "ls", cwd=tmp_path)
    assert code == 0, err
    same = await data_pool.queue.get(deeper)
    assert (await data_pool.queue.get(out.strip())).spec.project == same.spec.project
    code, shown, err = await poolctl(env, "show", deeper)
    assert code == 0, err
    [line] = [line for line in shown.splitlines() if line.startswith("project:")]
    assert "(not in git), 3 files" in line, line
    assert line.endswith("started in src"), line


async def test_poolignore_gitignore_and_workdir_none(data_pool: Pool, tmp_path: Path) -> None:
    """issue 45 item 1: a git project's untracked-not-ignored files go, .gitignore's and
    .poolignore's do not (tracked or not), `.git` never; --workdir none is today's scratch."""
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / ".gitignore").write_text("*.log\n")
    (repo / ".poolignore").write_text("data/\n")
    (repo / "data" / "big.bin").write_bytes(b"x" * 1000)
    (repo / "run.sh").write_text("echo committed\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "one")
    (repo / "new.txt").write_text("untracked\n")
    (repo / "debug.log").write_text("ignored\n")
    (repo / "passwd").symlink_to("/etc/passwd")  # out of the project: left out, saying so
    env = project_env(data_pool, tmp_path)
    script = "find . -type f | sort; [ -L passwd ] || echo no link"
    code, out, err = await poolctl(env, "enqueue", "--", "sh", "-c", script, cwd=repo)
    assert code == 0, err
    assert "left out 1 symlink(s) that point outside the project, e.g. passwd" in err
    log = await run(data_pool, tmp_path, out.strip())
    assert "no link" in log
    listed = [line for line in log.splitlines() if line.startswith("./")]
    assert listed == ["./.gitignore", "./.poolignore", "./new.txt", "./run.sh"], log

    code, out, err = await poolctl(env, "enqueue", "--workdir", "none", "--", "sh", "-c", script, cwd=repo)
    assert code == 0, err
    scratch = await run(data_pool, tmp_path, out.strip())
    assert [line for line in scratch.splitlines() if line.startswith("./")] == []


async def test_a_resubmit_sends_only_the_pack_that_changed(either_pool: Pool, tmp_path: Path) -> None:
    """issue 45 item 1: an unchanged resubmit stores nothing new; one changed file one new pack."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "requirements.txt").write_text("")
    for i in range(200):  # 200 x 100 KiB: 20 MB, packs of 4-16 MiB
        (project / f"f{i:03d}.bin").write_bytes(os.urandom(100 * 1024))
    env = project_env(either_pool, tmp_path)
    store = either_pool.server.store
    assert store is not None
    first = await enqueue(env, project, "true")
    objects = await stored(store)
    assert len(objects) >= 2  # packs, not one tar

    await enqueue(env, project, "true")
    assert await stored(store) == objects

    (project / "f123.bin").write_bytes(os.urandom(100 * 1024))
    changed = await enqueue(env, project, "true")
    assert len(await stored(store) - objects) == 1
    for job_id in (first, changed):
        await run(either_pool, tmp_path, job_id)


async def test_a_project_over_the_limit_is_refused_naming_its_biggest_file(
    data_pool: Pool, tmp_path: Path
) -> None:
    """issue 45 item 1: a project over project_max_bytes is refused before anything is sent,
    naming the big file and pointing to `poolctl put`; nothing is queued or stored."""
    project = tmp_path / "proj"
    (project / "data").mkdir(parents=True)
    (project / "pyproject.toml").write_text("")
    with open(project / "data" / "weights.bin", "wb") as f:  # sparse: 600 MiB, no bytes written
        f.truncate(600 * 2**20)
    env = project_env(data_pool, tmp_path)
    code, _, err = await poolctl(env, "enqueue", "--", "true", cwd=project)
    assert code == 2, err
    assert "data/weights.bin (600.0 MiB)" in err, err
    assert "poolctl put" in err, err
    assert data_pool.server.store is not None
    assert await stored(data_pool.server.store) == set()


async def test_a_bare_pyproject_is_locked_into_the_copy_never_into_the_tree(
    data_pool: Pool, tmp_path: Path
) -> None:
    """issue 45 item 1: a pyproject.toml declaring a project, with no lock, is locked by `uv lock`
    at submit and the lock goes with the job; the user's tree is left as it was. Without uv here,
    one sentence says so and the job runs all the same."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        '[project]\nname = "demo"\nversion = "0.1.0"\nrequires-python = ">=3.11"\ndependencies = []\n'
    )
    no_uv = project_env(data_pool, tmp_path, PATH="/usr/bin:/bin")
    code, out, err = await poolctl(no_uv, "enqueue", "--", "ls", cwd=project)
    assert code == 0, err
    assert "uv is not installed here" in err
    assert "uv.lock" not in await run(data_pool, tmp_path, out.strip())

    with_uv = project_env(data_pool, tmp_path, PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin")
    log = await run(data_pool, tmp_path, await enqueue(with_uv, project, "cat", "uv.lock"))
    assert 'name = "demo"' in log
    assert sorted(p.name for p in project.iterdir()) == ["pyproject.toml"]


async def test_an_array_runs_each_of_its_jobs_in_the_project(data_pool: Pool, tmp_path: Path) -> None:
    """issue 45 item 1: `--array` from a project: every job of it runs in the project's copy."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "requirements.txt").write_text("")
    (project / "lr.txt").write_text("3e-4\n")
    env = project_env(data_pool, tmp_path)
    code, out, err = await poolctl(
        env, "enqueue", "--json", "--array", "0-1", "--", "cat", "lr.txt", cwd=project
    )
    assert code == 0, err
    for job_id in orjson.loads(out.splitlines()[0])["jobs"]:
        assert "3e-4" in await run(data_pool, tmp_path, job_id)


async def test_the_server_refuses_a_project_over_its_own_bound(redis_server: object, tmp_path: Path) -> None:
    """issue 45 item 1: a poolctl that lets a larger project through is refused by the server's
    project_max_bytes, saying so."""
    store = LocalStore(tmp_path / "store")
    async with running_pool(redis_server, tmp_path, store=store, project_max_bytes=1000) as pool:  # type: ignore[arg-type]
        project = tmp_path / "proj"
        project.mkdir()
        (project / "requirements.txt").write_text("x" * 2000)
        code, _, err = await poolctl(project_env(pool, tmp_path), "enqueue", "--", "true", cwd=project)
    assert code == 2, err
    assert "is 2000 bytes, more than the 1000 bytes a job's project may be (project_max_bytes)" in err


def test_the_spec_takes_a_project_only_as_poolctl_makes_it() -> None:
    """issue 45 item 1: the server checks a project's entry: its id is its packs', its dir stays
    inside the job's directory, and it runs in no other place (--cwd, --git)."""
    packs = ["a" * 64, "b" * 64]
    good = {"id": project_id(packs), "packs": packs, "dir": "src", "commit": "", "dirty": True}
    good |= {"files": 2, "size": 10}
    assert JobSpec.from_dict({"argv": ["true"], "project": good}).project == good
    for bad, why in [
        ({**good, "id": "c" * 64}, "its id is not the sha256 of its packs"),
        ({**good, "dir": "../up"}, "must be a relative path inside the project"),
        ({**good, "packs": ["nothex"]}, "packs must be a list of at most"),
    ]:
        with pytest.raises(InvalidJob, match=why):
            JobSpec.from_dict({"argv": ["true"], "project": bad})
    with pytest.raises(InvalidJob, match="cannot be combined with cwd"):
        JobSpec.from_dict({"argv": ["true"], "project": good, "cwd": "/data"})


async def test_another_users_packs_are_neither_runnable_nor_shown(data_pool: Pool, tmp_path: Path) -> None:
    """issue 45 item 1: a job may name as its project only packs its user uploaded (knowing
    sha256s is not having the files, nor is a pack another's held for a resubmit), and another
    user's view of a job hides its packs."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "requirements.txt").write_text("secret-sauce==1.0\n")
    alice_env = project_env(data_pool, tmp_path)
    job_id = await enqueue(alice_env, project, "true")
    async with data_pool.client("alice") as alice:
        entry = (await alice.call(ShowJob(job_id), JobDetail)).job["spec"]["project"]
    assert entry["packs"]
    async with data_pool.client("alice") as alice:
        assert (await alice.call(CheckObjects(entry["packs"]), ObjectsHeld)).sha256s == entry["packs"]
    async with data_pool.client("bob") as bob:
        assert (await bob.call(CheckObjects(entry["packs"]), ObjectsHeld)).sha256s == []  # not his
        with pytest.raises(ClientError) as err:
            await bob.call(Enqueue({"argv": ["cat", "requirements.txt"], "project": entry}, None), Enqueued)
        assert err.value.code == ErrorCode.PERMISSION_DENIED
        seen = (await bob.call(ShowJob(job_id), JobDetail)).job["spec"]["project"]
    assert "packs" not in seen
    assert seen["id"] == entry["id"]


async def test_the_resubmit_bench_runs_at_its_smallest() -> None:
    """issue 45 item 1: bench/project_resubmit.py keeps working (its --tiny size; it measures,
    this asserts no speed): a resubmit of the unchanged project sends nothing."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.project_resubmit", "--tiny", cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out = (await asyncio.wait_for(proc.communicate(), 90))[0].decode()
    assert proc.returncode == 0, out
    [unchanged] = [line for line in out.splitlines() if "unchanged resubmit" in line]
    assert unchanged.split("│")[3].strip() == "0", out
