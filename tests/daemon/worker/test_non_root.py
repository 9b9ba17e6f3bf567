"""A worker that does not run as root (daemon/worker/non_root.py): a real `poold --worker` started
as an unprivileged uid, as a pilot on a batch cluster runs. It serves one pool user only, refusing
to start without one; another user's job is never claimed there, and does not hold the served
user's jobs back; a job there cannot read the worker's /proc environ or open its descriptors; and
its data directory must be its own and closed to others. The whole of a pilot run as an
unprivileged cluster user is tests/daemon/ctl/test_pilot.py."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from daemon.job import JobState
from daemon.queue import registry
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from tests.support import unprivileged
from tests.support.paths import ROOT
from tests.support.workers import sh, wait_state, wait_until

UID = 61_017  # the worker's: a uid of no real user, as a cluster user's would be to the pool


@pytest.fixture
def home() -> Iterator[Path]:
    """A directory of UID's own under the system's /tmp (pytest's is root's, closed to others)."""
    path = Path(tempfile.mkdtemp(prefix="gpupool-nonroot-"))
    os.chown(path, UID, UID)
    try:
        with unprivileged.reachable():
            yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def as_uid(*argv: str) -> list[str]:
    """`argv` as UID, no groups, no capabilities: what an unprivileged user's process has."""
    return ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", "--inh-caps=-all", *argv]


def worker_argv(redis_server: EmbeddedRedis, data_dir: Path, *flags: str) -> list[str]:
    return as_uid(
        unprivileged.python(), "-m", "daemon.main", "--worker", "--worker-mode", "multinode",
        "--redis-port", str(redis_server.port), "--metrics-listen", "127.0.0.1:0",
        "--data-dir", str(data_dir), "--heartbeat-interval", "0.5", *flags,
    )  # fmt: skip


def worker_env(redis_server: EmbeddedRedis, s3_env: dict[str, str], home: Path) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "PYTHONPATH": unprivileged.pythonpath(),
        "GPUPOOL_MAIN_SERVER_REDIS_PASSWORD": redis_server.password,
        **s3_env,
    }


def refusal(argv: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


def test_a_worker_not_running_as_root_must_serve_one_user_and_keep_its_data_closed(
    redis_server: EmbeddedRedis, home: Path
) -> None:
    """issue 44 items 1 and 3: a pilot started with no user to serve would run every pool user's
    jobs as its own user, who reads its config; and a data directory planted before it (another's,
    or open to others) was used as it was. Both stop it in a sentence, before it connects."""
    env = worker_env(redis_server, {}, home)
    said = refusal(worker_argv(redis_server, home / "data"), env)
    assert "this worker does not run as root" in said
    assert "set worker_serve_user (--serve-user USER" in said
    assert "run it as an agent of the pool server (worker_via_server, worker_token_file" in said
    assert not (home / "data").exists()
    planted = home / "planted"
    planted.mkdir(mode=0o755)
    os.chmod(planted, 0o755)
    os.chown(planted, UID, UID)
    said = refusal(worker_argv(redis_server, planted, "--serve-user", "alice"), env)
    assert f"the data directory {planted} (uid {UID}, mode 755) must be this worker's own" in said
    os.chmod(planted, 0o700)
    os.chown(planted, 0, 0)  # another's: root's here
    said = refusal(worker_argv(redis_server, planted, "--serve-user", "alice"), env)
    assert f"(uid 0, mode 700) must be this worker's own (uid {UID})" in said


async def test_a_worker_not_running_as_root_runs_its_users_jobs_only_none_reads_its_secrets(
    redis_server: EmbeddedRedis, queue: JobQueue, s3_env: dict[str, str], home: Path
) -> None:
    """issue 44 item 1: Bob's job on Alice's pilot found the worker's config through /proc and read
    the pool's credentials. Now Alice's worker passes Bob's job over (it stays queued, untouched)
    and runs Alice's, queued behind it; and that job, of the worker's own uid, can neither read
    the worker's /proc environ (its Redis password) nor open its descriptors: the worker made
    itself non-dumpable at its start. Nor can it read the password in any process the worker
    started (its orphan guard had the worker's whole environment). Its data directory, made by the
    worker, is mode 700."""
    probe = home / "probe"
    argv = worker_argv(redis_server, home / "data", "--serve-user", "alice")
    with (
        open(home / "worker.log", "wb") as log,
        subprocess.Popen(argv, env=worker_env(redis_server, s3_env, home), cwd=ROOT, stderr=log) as proc,
    ):
        try:

            async def registered() -> bool:
                return len(await registry.list_workers(queue.redis)) == 1

            try:
                await wait_until(registered, 30, "the worker to register")
            except AssertionError:
                raise AssertionError((home / "worker.log").read_text()) from None
            pid = proc.pid  # setpriv execs the worker: the same process
            bobs, _ = await queue.enqueue(sh("true", user="bob"))
            script = (
                f"cat /proc/{pid}/environ > {probe}.environ 2> {probe}.environ.err;"
                f"ls /proc/{pid}/fd/ > {probe}.fd 2> {probe}.fd.err;"
                f"cat /proc/{pid}/fd/0 < /dev/null > /dev/null 2> {probe}.fd0.err; id -u > {probe}.uid;"
                # every environment and command line it may read, each after its path
                f"for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do printf '\\n%s\\n' $f; "
                f"cat $f 2>/dev/null | tr '\\0' '\\n'; done > {probe}.all"
            )
            guards = [child.pid for child in psutil.Process(pid).children() if "-I" in child.cmdline()]
            alices, _ = await queue.enqueue(sh(script, user="alice"))
            info = await wait_state(queue, alices, JobState.SUCCEEDED, JobState.FAILED, timeout=30)
            assert info.state is JobState.SUCCEEDED, info.detail
            bob = await queue.get(bobs)
            assert (bob.state, bob.attempt) == (JobState.QUEUED, 0)
        finally:
            proc.terminate()
            await asyncio.to_thread(proc.wait, 30)
    log_text = (home / "worker.log").read_text()
    assert Path(f"{probe}.uid").read_text().strip() == str(UID), log_text  # the worker's own uid
    # its one user's jobs can read the pool's credentials in its config: it says so, and the way out
    assert "holds the pool's Redis password and S3 keys, which alice's jobs here can read" in log_text
    assert Path(f"{probe}.environ").read_text() == ""
    assert "Permission denied" in Path(f"{probe}.environ.err").read_text()
    assert "Permission denied" in Path(f"{probe}.fd.err").read_text()
    assert "Permission denied" in Path(f"{probe}.fd0.err").read_text()
    assert (home / "data").stat().st_mode & 0o777 == 0o700
    # nor any process the worker started: its orphan guard, dumpable after its exec, had the
    # worker's whole environment, the Redis password included
    seen = Path(f"{probe}.all").read_text()
    assert len(guards) == 1
    assert f"\n/proc/{guards[0]}/environ\nPATH=" in seen  # the guard's environment, read
    assert redis_server.password not in seen
    assert s3_env["GPUPOOL_MAIN_SERVER_MINIO_SECRET_ACCESS_KEY"] not in seen


CACHE_PROBE = """
import asyncio, hashlib, stat, sys
from pathlib import Path
from storage.cache import ObjectCache
from storage.content import content_key
from storage.local import LocalStore

async def main(top: Path) -> None:
    store = LocalStore(top / "store")
    await store.open()
    data = b"alice's dataset"
    sha = hashlib.sha256(data).hexdigest()
    await store.put_bytes(content_key(sha), data)
    path = await ObjectCache(top / "cache", store, max_bytes=2**20).fetch(sha)
    print(oct(stat.S_IMODE(path.stat().st_mode)))

asyncio.run(main(Path(sys.argv[1])))
"""


def test_a_worker_not_running_as_root_keeps_its_cached_objects_to_itself(home: Path) -> None:
    """issue 44 item 3: a pilot's cache objects were 0444, for slot uids a non-root worker never
    has: any user who reached the tree read every dataset. Fetched by the worker's uid, an object
    is its owner's alone to read (its jobs run as that uid)."""
    done = subprocess.run(
        as_uid(unprivileged.python(), "-c", CACHE_PROBE, str(home)),
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": unprivileged.pythonpath()},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0o400"
