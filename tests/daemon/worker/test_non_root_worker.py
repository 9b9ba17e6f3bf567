"""Slots whose jobs run as the daemon's own uid, because it is not root: a single-machine pool run
by a plain user for several users (a tokens file), a worker on one person's machine, a pilot. What
those jobs must still not do to each other. A real `poold` run as a plain uid
(tests/support/plain_uid.py), its own embedded Redis and local store, real jobs."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from redis.asyncio import Redis

from daemon.job import JobInfo, JobState
from daemon.queue import connection
from daemon.queue.job_queue import JobQueue
from storage.content import content_key
from storage.local import LocalStore
from tests.support import uids, unprivileged
from tests.support.plain_uid import as_uid
from tests.support.workers import sh, wait_state

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="starting poold as another uid needs root")

POOLD_UID = uids.uid(39)  # no real user's: the pool's owner, as a workstation's user would be


@asynccontextmanager
async def pool_of_a_plain_uid(
    objects: dict[str, bytes], *flags: str, tokens: dict[str, str] | None = None
) -> AsyncIterator[JobQueue]:
    """`poold` (a single-machine pool, one local slot) as POOLD_UID, its store holding `objects`
    (sha256: bytes) as if users had uploaded them, given `flags` and a tokens file of `tokens`
    (user: token) if any; yields a queue on its Redis to enqueue jobs as the server would, for any
    user. Stopped at the end."""
    top = Path(tempfile.mkdtemp(prefix="gpupool-plain-pool-"))
    # this checkout may sit in a directory the uid cannot pass (a clone in a `mktemp -d`, or
    # under /root): passable while the pool runs
    with unprivileged.reachable():
        try:
            argv, env = await _plain_poold(top, objects, *flags, tokens=tokens)
            log = top / "poold.log"
            try:
                with (
                    open(log, "wb") as out,
                    subprocess.Popen(argv, env=env, stderr=out) as proc,
                ):
                    try:
                        redis = await _its_redis(top / "data", log, proc)
                        try:
                            yield JobQueue(redis, lease_seconds=30)
                        finally:
                            await redis.aclose()
                    finally:
                        proc.terminate()
                        proc.wait(30)
            except BaseException:
                sys.stderr.write(log.read_text(errors="replace"))
                raise
        finally:
            shutil.rmtree(top, ignore_errors=True)


async def _plain_poold(
    top: Path, objects: dict[str, bytes], *flags: str, tokens: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of POOLD_UID's `poold` whose data is under `top`."""
    top.chmod(0o711)
    data, home = top / "data", top / "home"
    async with LocalStore(data / "store") as store:
        for sha, content in objects.items():
            await store.put_bytes(content_key(sha), content)
    home.mkdir()
    (top / "ns").mkdir()  # what the uid's mount namespace mounts over (plain_uid.py)
    argv = [sys.executable, "-m", "daemon.main", "--data-dir", str(data), "--worker-local-processors", "1"]
    argv += ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--web-listen", "off", *flags]
    owned = [data, home, *data.rglob("*")]
    if tokens is not None:
        tokens_file = top / "tokens.toml"
        tokens_file.write_text("".join(f'{user} = "{token}"\n' for user, token in tokens.items()))
        tokens_file.chmod(0o600)
        owned.append(tokens_file)
        argv += ["--tokens-file", str(tokens_file)]
    for path in owned:
        os.chown(path, POOLD_UID, POOLD_UID)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "USER": "carol", "XDG_CONFIG_HOME": str(home)}
    return as_uid(POOLD_UID, argv, top / "ns"), env


async def _its_redis(data: Path, log: Path, proc: subprocess.Popen[bytes]) -> Redis:
    """A client of the pool's embedded Redis, once the pool says it is ready."""
    for _ in range(600):
        if "server ready on" in log.read_text(errors="replace"):
            break
        if proc.poll() is not None:
            raise AssertionError("poold exited before it was ready")
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("poold was not ready within 30 s")
    port = json.loads((data / "redis" / "server.json").read_text())["port"]
    password = (data / "redis" / "password").read_text().strip()
    return connection.connect("127.0.0.1", port, password=password)


async def said(queue: JobQueue, info: JobInfo) -> str:
    """What the job wrote (the worker's own `[gpupool]` notes left out)."""
    log = b"".join(data for _, data in await queue.read_log(info.id)).decode()
    return "".join(line for line in log.splitlines(keepends=True) if not line.startswith("[gpupool]"))


async def test_a_job_cannot_change_the_input_the_next_users_job_reads() -> None:
    """issue 44 item 2: where jobs run as the daemon's own uid, that uid owns the cache's inodes;
    an input that was a hard link to its cache entry could be made writable and overwritten, and
    the next job, another user's, a cache hit, read the poisoned bytes. Each job now gets an inode
    of its own: alice's overwrite changes her copy alone."""
    true = b"the true bytes\n"
    sha = hashlib.sha256(true).hexdigest()
    inputs = ({"sha256": sha, "dest": "data.bin", "kind": "file"},)
    attack = "id -u; chmod u+w data.bin && printf poisoned > data.bin; cat data.bin; echo"
    async with pool_of_a_plain_uid({sha: true}) as queue:
        alices, _ = await queue.enqueue(sh(attack, inputs=inputs, user="alice"))
        bobs, _ = await queue.enqueue(sh("cat data.bin", inputs=inputs, user="bob"))
        ended = (JobState.SUCCEEDED, JobState.FAILED)
        alice = await wait_state(queue, alices, *ended)
        bob = await wait_state(queue, bobs, *ended)
        alice_said, bob_said = await said(queue, alice), await said(queue, bob)
    assert alice.state is JobState.SUCCEEDED, alice_said
    assert alice_said.split() == [str(POOLD_UID), "poisoned"]  # the attack ran, on her own copy
    assert bob.state is JobState.SUCCEEDED, bob_said
    assert bob_said.encode() == true  # a cache hit: bob reads the verified bytes


TWO_USERS = {"alice": "a" * 32, "bob": "b" * 32}


async def test_a_plain_uids_server_runs_local_slots_for_one_user_only() -> None:
    """issue 44 item 1: a single-machine pool run by a plain uid for several users (a tokens file)
    ran every user's job as that uid, which reads the data directory: every user's token, the
    Redis password, the stored data. Such a server now refuses to start, saying what to set; with
    worker_serve_user its slots run that user's jobs only, and another user's job stays queued."""
    top = Path(tempfile.mkdtemp(prefix="gpupool-plain-pool-"))  # pytest's is closed to the uid
    with unprivileged.reachable():  # as in pool_of_a_plain_uid
        try:
            argv, env = await _plain_poold(top, {}, tokens=TWO_USERS)
            with subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True) as proc:
                try:
                    _, said = await asyncio.to_thread(proc.communicate, timeout=30)
                except subprocess.TimeoutExpired:
                    proc.terminate()  # it stops its Redis
                    proc.communicate(timeout=30)
                    pytest.fail("poold started: its slot runs every user's jobs as its own uid")
        finally:
            shutil.rmtree(top, ignore_errors=True)
    assert proc.returncode == 1, said
    assert "Traceback" not in said
    assert "this server does not run as root, so its local slots would run the jobs of all 2 users" in said
    assert "set worker_serve_user (--worker-serve-user USER" in said
    async with pool_of_a_plain_uid({}, "--worker-serve-user", "alice", tokens=TWO_USERS) as queue:
        bobs, _ = await queue.enqueue(sh("true", user="bob"))
        alices, _ = await queue.enqueue(sh("true", user="alice"))
        alice = await wait_state(queue, alices, JobState.SUCCEEDED, JobState.FAILED)
        bob = await queue.get(bobs)
    assert alice.state is JobState.SUCCEEDED
    assert (bob.state, bob.attempt) == (JobState.QUEUED, 0)
