"""A job runs in the environment its lock describes (issue 45 item 2): built once per worker by
the real uv from a local wheelhouse (hermetic: the only index the worker is given is a dead
address, so nothing leaves the machine), shared, evicted only when unused, read-only to jobs.
Real jobs on a root worker with slot uids, and a builder uid of its own."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from daemon.ctl import commands
from daemon.ctl.enqueue_spec import spec_of
from daemon.errors import InvalidJob
from daemon.job import JobInfo, JobSpec, JobState
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.worker.dispatcher import Worker
from daemon.worker.env_build import NO_INDEX, EnvSettings, find_uv
from daemon.worker.env_lock import find_lock, hash_pinned
from daemon.worker.envs import EnvCache
from daemon.worker.identity import SlotIdentity, slot_identities
from storage.local import LocalStore
from tests.support import uids
from tests.support.git_repo import git
from tests.support.pool import running_pool
from tests.support.poolctl import poolctl
from tests.support.wheels import locked_project, make_wheel
from tests.support.workers import running_worker, wait_state

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching uids needs root")

FIRST_UID = uids.uid(0)
BUILDER = SlotIdentity(uids.uid(90), uids.uid(90))
# The index is the worker's, with a credential in it: uv is given it (and, were it reached, it
# would fail: the builds here are the wheelhouse's alone); a job must never see it.
DEAD_INDEX = "http://builder:index-s3cret@127.0.0.1:9/simple"


@pytest.fixture
def place() -> Iterator[Path]:
    """A directory every uid may pass and read (in /tmp: pytest's own are root's, 0700): the
    wheelhouse the builder reads, the projects the jobs run in, the worker's data directory."""
    path = Path(tempfile.mkdtemp(prefix="gpupool-envs-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def wheelhouse(place: Path) -> Path:
    wheels = place / "wheels"
    make_wheel(wheels, "tinypkg", "1.0")
    make_wheel(wheels, "otherpkg", "2.0")
    return wheels


def project(place: Path, wheelhouse: Path, name: str, *requirements: str) -> Path:
    path = locked_project(place / name, wheelhouse, *requirements)
    for top, dirs, files in os.walk(path):
        for entry in (*dirs, *files):
            os.chmod(os.path.join(top, entry), 0o755)
    path.chmod(0o755)
    return path


def settings(wheelhouse: Path, **kw: object) -> EnvSettings:
    return EnvSettings(index_url=DEAD_INDEX, find_links=(str(wheelhouse),), **kw)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def env_worker(queue: JobQueue, place: Path, wheelhouse: Path, **kw: object) -> AsyncIterator[Worker]:
    identities = slot_identities(f"{FIRST_UID}-{FIRST_UID + 1}", 2)
    env = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8"}
    data = place / "data"
    data.mkdir()
    data.chmod(0o711)
    async with running_worker(
        queue,
        data / "w",
        slots=2,
        identities=identities,
        env=env,
        env_settings=settings(wheelhouse, **kw),
        env_builder=BUILDER,
    ) as w:
        yield w


async def run(queue: JobQueue, cwd: Path, script: str, **kw: object) -> JobInfo:
    job_id, _ = await queue.enqueue(JobSpec(argv=("sh", "-c", script), cwd=str(cwd), **kw))  # type: ignore[arg-type]
    return await wait_state(queue, job_id, JobState.SUCCEEDED, JobState.FAILED, timeout=60)


async def output(queue: JobQueue, info: JobInfo) -> str:
    return b"".join(data for _, data in await queue.read_log(info.id)).decode()


@pytest.mark.parametrize("bytecode_later", [True, False], ids=["bytecode later", "bytecode in the build"])
async def test_a_job_imports_its_locked_package_and_never_sees_the_index(
    queue: JobQueue, place: Path, wheelhouse: Path, bytecode_later: bool
) -> None:
    """issue 45 item 2: the job's directory has uv.lock; it runs in the environment built from
    it (VIRTUAL_ENV, its bin first on PATH: `python` and the package's own script are the
    environment's), and the worker's index, credential and all, is neither in the job's
    environment nor anywhere in the environment's files. With the bytecode made after the
    environment is published (the speed switch), and without."""
    proj = project(place, wheelhouse, "proj", "tinypkg==1.0")
    async with env_worker(queue, place, wheelhouse, bytecode_later=bytecode_later) as worker:
        info = await run(queue, proj, 'python -c "import tinypkg; print(tinypkg.VERSION)"; tinypkg; env')
        log = await output(queue, info)
        assert info.state is JobState.SUCCEEDED, log
        lines = log.splitlines()
        assert "1.0" in lines
        assert "tinypkg 1.0" in lines
        env = dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("uv"))
        venv = Path(env["VIRTUAL_ENV"])
        assert venv.parent == worker.data_dir / "envs" / "built"
        assert env["PATH"].startswith(f"{venv}/bin:")
        assert "s3cret" not in log
        await worker.envs.settled()
        assert list((venv / "lib").glob("python3*/site-packages/tinypkg/__pycache__/__init__.*.pyc"))
        for top, _, files in os.walk(venv):
            for name in files:
                path = os.path.join(top, name)
                if not os.path.islink(path):
                    assert b"s3cret" not in Path(path).read_bytes(), path

        bare = await run(queue, proj, 'echo "${VIRTUAL_ENV:-none}"', env_from_lock=False)  # --no-env
        assert (await output(queue, bare)).splitlines()[-1] == "none"


async def test_two_jobs_needing_one_environment_share_one_build(
    queue: JobQueue, place: Path, wheelhouse: Path
) -> None:
    """issue 45 item 2: two jobs starting together wait for one build; a later one finds it
    built (no uv runs). Under the shipped units' umask (0027), which the builder and the jobs,
    other uids than the worker's, must not feel."""
    proj = project(place, wheelhouse, "proj", "tinypkg==1.0")
    umask = os.umask(0o027)
    try:
        await _share_one_build(queue, place, wheelhouse, proj)
    finally:
        os.umask(umask)


async def _share_one_build(queue: JobQueue, place: Path, wheelhouse: Path, proj: Path) -> None:
    async with env_worker(queue, place, wheelhouse) as worker:
        infos = await asyncio.gather(*(run(queue, proj, "python -c 'import tinypkg'") for _ in range(2)))
        assert [i.state for i in infos] == [JobState.SUCCEEDED] * 2
        assert worker.envs.builds == 1
        later = await run(queue, proj, "python -c 'import tinypkg'")
        assert later.state is JobState.SUCCEEDED
        assert "(built before)" in await output(queue, later)
        assert worker.envs.builds == 1


async def test_a_failed_build_fails_only_its_job_with_uvs_error_in_its_log(
    queue: JobQueue, place: Path, wheelhouse: Path
) -> None:
    """issue 45 item 2: a lock naming a wheel that is not to be had fails its job, with uv's own
    words and one sentence; the worker goes on to run the next job. A lock needing a Python
    the worker lacks (downloads off) fails its job saying so."""
    proj = project(place, wheelhouse, "broken", "otherpkg==2.0")
    (wheelhouse / "otherpkg-2.0-py3-none-any.whl").unlink()
    old = project(place, wheelhouse, "old", "tinypkg==1.0")
    (old / ".python-version").write_text("3.99\n")
    old.joinpath(".python-version").chmod(0o644)
    async with env_worker(queue, place, wheelhouse):
        failed = await run(queue, proj, "echo ran")
        log = await output(queue, failed)
        assert failed.state is JobState.FAILED, log
        assert "otherpkg" in log
        assert "uv: " in log
        assert "ran" not in log
        assert failed.detail.startswith("cannot build the job's environment from its uv.lock")

        needs = await run(queue, old, "echo ran")
        assert needs.state is JobState.FAILED
        assert "needs a Python this worker does not have" in needs.detail, await output(queue, needs)

        fine = await run(queue, place, "echo alive")
        assert fine.state is JobState.SUCCEEDED


async def test_a_job_cannot_write_into_a_cached_environment(
    queue: JobQueue, place: Path, wheelhouse: Path
) -> None:
    """issue 45 item 2: the environment is the worker's and read-only: a job (a slot uid) can
    neither change a module of it, nor add a file, nor make one writable."""
    proj = project(place, wheelhouse, "proj", "tinypkg==1.0")
    module = 'python -c "import tinypkg; print(tinypkg.__file__)"'
    attempts = (
        f'f=$({module}); echo "VERSION = 666" >> "$f" && echo wrote-module; '
        'touch "$VIRTUAL_ENV/bin/mine" && echo wrote-bin; '
        'chmod u+w "$f" && echo chmodded; '
        'python -c "import tinypkg; print(tinypkg.VERSION)"'
    )
    async with env_worker(queue, place, wheelhouse) as worker:
        info = await run(queue, proj, attempts)
        log = await output(queue, info)
        assert info.state is JobState.SUCCEEDED, log
        assert "wrote-module" not in log
        assert "wrote-bin" not in log
        assert "chmodded" not in log
        assert log.splitlines()[-1] == "1.0"
        # and no later build (the builder's uid, running a package's code) could change it either,
        # its bytecode, made later by that uid, included
        await worker.envs.settled()
        venv = next((worker.data_dir / "envs" / "built").iterdir())
        assert list(venv.glob("lib/python3*/site-packages/tinypkg/__pycache__/*.pyc"))
        for top, dirs, files in os.walk(venv):
            for name in (*dirs, *files):
                st = os.lstat(os.path.join(top, name))
                assert (st.st_uid, st.st_gid) == (0, 0), name
                assert stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o022, name
                assert stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode) or not st.st_mode & 0o200, name


async def test_eviction_never_removes_an_environment_in_use(place: Path, wheelhouse: Path) -> None:
    """issue 45 item 2: with a budget smaller than any environment, the one a job holds stays
    through the builds of others; once let go, it is evicted."""
    first = find_lock(project(place, wheelhouse, "first", "tinypkg==1.0"))
    second = find_lock(project(place, wheelhouse, "second", "otherpkg==2.0"))
    assert first is not None
    assert second is not None
    envs = EnvCache(place / "envs", settings(wheelhouse, budget_bytes=1), builder=BUILDER)
    await asyncio.to_thread(envs.open)
    try:
        held = await envs.use(first, lambda _: None)
        other = await envs.use(second, lambda _: None)
        other.release()
        await envs.settled()  # (its bytecode being made holds it too)
        await envs.evict()
        assert held.path.is_dir()  # in use: kept, over the budget
        assert not other.path.exists()  # let go: evicted
        held.release()
        await envs.evict()
        assert not held.path.exists()
        assert envs.size() == 0
    finally:
        await envs.close()


async def test_a_git_job_gets_the_environment_of_the_lock_at_its_commit(
    queue: JobQueue, place: Path, wheelhouse: Path
) -> None:
    """issue 45 item 2: a --git job's directory is its repository at its commit, whose lock
    gives its environment: the lock committed first (tinypkg), not the one after (otherpkg)."""
    repo = place / "repo"
    project(place, wheelhouse, "repo", "tinypkg==1.0")
    git(repo, "init", "--quiet", "--initial-branch=main")
    git(repo, "add", "pyproject.toml", "uv.lock")
    git(repo, "commit", "--quiet", "-m", "tinypkg")
    first = git(repo, "rev-parse", "HEAD")
    locked_project(repo, wheelhouse, "otherpkg==2.0")
    git(repo, "commit", "--quiet", "-am", "otherpkg")
    script = "python -c 'import tinypkg; print(tinypkg.VERSION)'"
    async with env_worker(queue, place, wheelhouse):
        job_id, _ = await queue.enqueue(
            JobSpec(argv=("sh", "-c", script), git={"repo": str(repo), "commit": first})
        )
        info = await wait_state(queue, job_id, JobState.SUCCEEDED, JobState.FAILED, timeout=60)
        assert info.state is JobState.SUCCEEDED, await output(queue, info)
        assert (await output(queue, info)).splitlines()[-1] == "1.0"


async def test_pylock_and_hash_pinned_requirements_are_locks_too(place: Path, wheelhouse: Path) -> None:
    """issue 45 item 2: a pylock.toml, and a requirements.txt pinned to hashes, each give an
    environment, built from the worker's find-links alone (worker_env_index_url = "none")."""
    source = project(place, wheelhouse, "source", "tinypkg==1.0")
    uv = find_uv()
    assert uv is not None
    pylock = place / "pylock"
    pylock.mkdir()
    export = [uv, "export", "--frozen", "--quiet", "--no-config", "--project", str(source)]
    subprocess.run(
        [*export, "--format", "pylock.toml", "-o", str(pylock / "pylock.toml")], check=True, timeout=60
    )
    pinned = place / "pinned"
    pinned.mkdir()
    digest = hashlib.sha256((wheelhouse / "tinypkg-1.0-py3-none-any.whl").read_bytes()).hexdigest()
    (pinned / "requirements.txt").write_text(f"tinypkg==1.0 \\\n    --hash=sha256:{digest}\n")
    envs = EnvCache(
        place / "envs", EnvSettings(index_url=NO_INDEX, find_links=(str(wheelhouse),)), builder=BUILDER
    )
    await asyncio.to_thread(envs.open)
    try:
        for directory, kind in ((pylock, "pylock.toml"), (pinned, "requirements.txt")):
            lock = find_lock(directory)
            assert lock is not None
            assert lock.kind == kind
            held = await envs.use(lock, lambda _: None)
            python = held.path / "bin" / "python"
            out = subprocess.run(
                [python, "-c", "import tinypkg; print(tinypkg.VERSION)"],
                capture_output=True,
                text=True,
                check=False,
            )
            assert out.stdout == "1.0\n", out.stderr
            held.release()
        assert envs.builds == 2
    finally:
        await envs.close()


async def test_two_workers_sharing_a_machines_cache_build_once(place: Path, wheelhouse: Path) -> None:
    """issue 45 item 2: two caches on one directory (two workers of a machine: each its own lock
    files' descriptors, as two processes have) asked for one environment at once: one builds,
    the other waits for its lock and finds it built."""
    lock = find_lock(project(place, wheelhouse, "proj", "tinypkg==1.0"))
    assert lock is not None
    caches = [EnvCache(place / "envs", settings(wheelhouse), builder=BUILDER) for _ in range(2)]
    for envs in caches:
        await asyncio.to_thread(envs.open)
    try:
        first, second = await asyncio.gather(*(envs.use(lock, lambda _: None) for envs in caches))
        assert first.path == second.path
        assert sum(envs.builds for envs in caches) == 1
        first.release()
        second.release()
    finally:
        for envs in caches:
            await envs.close()


def test_only_a_requirements_file_pinned_to_hashes_is_a_lock() -> None:
    """issue 45 item 2: a requirements.txt is a lock only when every requirement has a version
    and its hashes and nothing else is said (no index, no other file)."""
    pinned = b"# locked\ntinypkg==1.0 \\\n    --hash=sha256:" + b"a" * 64 + b"\n\n"
    assert hash_pinned(pinned)
    assert not hash_pinned(b"tinypkg==1.0\n")
    assert not hash_pinned(pinned + b"--index-url https://example.org/simple\n")
    assert not hash_pinned(pinned + b"otherpkg>=2 --hash=sha256:" + b"b" * 64 + b"\n")
    assert not hash_pinned(b"# nothing\n")


def test_no_env_is_sent_only_when_asked_for() -> None:
    """issue 45 item 2: `poolctl enqueue --no-env` sends `env_from_lock: false`, which a spec
    keeps; a spec without it says nothing (a worker from before refuses a field it does not know)."""
    spec = spec_of(commands.parser().parse_args(["enqueue", "--no-env", "--", "python", "train.py"]))
    assert spec["env_from_lock"] is False
    assert JobSpec.from_dict(spec).to_dict()["env_from_lock"] is False
    plain = spec_of(commands.parser().parse_args(["enqueue", "--", "python", "train.py"]))
    assert "env_from_lock" not in plain
    assert "env_from_lock" not in JobSpec.from_dict(plain).to_dict()
    with pytest.raises(InvalidJob, match="env_from_lock"):
        JobSpec.from_dict({"argv": ["true"], "env_from_lock": "no"})


async def test_a_project_job_started_below_its_top_runs_in_the_projects_environment(
    redis_server: EmbeddedRedis, tmp_path: Path, place: Path, wheelhouse: Path
) -> None:
    """issue 45 item 2 with item 1: `poolctl enqueue` from a directory inside a locked project
    sends the project; the job, started in that directory, runs in the environment of the lock
    at the project's top, as `uv run` there would."""
    proj = project(place, wheelhouse, "proj", "tinypkg==1.0")
    (proj / "src").mkdir()
    (proj / "src" / "train.py").write_text("import tinypkg\nprint('trained with', tinypkg.VERSION)\n")
    async with running_pool(redis_server, tmp_path, store=LocalStore(tmp_path / "store")) as pool:
        env = pool.env("alice", XDG_CACHE_HOME=str(tmp_path / "cache"))
        code, out, err = await poolctl(env, "enqueue", "--", "python", "train.py", cwd=proj / "src")
        assert code == 0, err
        async with running_worker(pool.queue, tmp_path / "w", store=pool.server.store, slots=1) as worker:
            info = await wait_state(pool.queue, out.strip(), JobState.SUCCEEDED, JobState.FAILED, timeout=60)
            log = await output(pool.queue, info)
            assert info.state is JobState.SUCCEEDED, log
            assert "trained with 1.0" in log
            assert worker.envs.builds == 1
