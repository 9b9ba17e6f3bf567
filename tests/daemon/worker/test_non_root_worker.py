"""A worker that is not root (a pilot, a worker on one person's machine) runs every user's jobs as
its own uid: what those jobs must still not do to each other. A real `poold --worker` run as a
plain uid (tests/support/unprivileged.py), on a real Redis and a real S3 endpoint."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from daemon.job import JobInfo, JobState
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from storage.content import content_key
from storage.s3 import S3Store
from tests.support.unprivileged import as_uid
from tests.support.workers import sh, wait_state

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="starting a worker as another uid needs root")

S3_NAMES = ("ADDRESS", "BUCKET", "ACCESS_KEY_ID", "SECRET_ACCESS_KEY")
WORKER_UID = 61390  # no real user's: the worker's own, as a cluster user's pilot is


@contextmanager
def worker_as_plain_uid(redis_server: EmbeddedRedis, s3_env: dict[str, str]) -> Iterator[None]:
    """`poold --worker` with one slot, as WORKER_UID; stopped (drained) at the end."""
    top = Path(tempfile.mkdtemp(prefix="gpupool-plain-worker-"))
    top.chmod(0o711)
    (top / "data").mkdir()
    os.chown(top / "data", WORKER_UID, WORKER_UID)
    (top / "ns").mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(top / "data"),
        "GPUPOOL_WORKER_MODE": "multinode",
        "GPUPOOL_REDIS_PORT": str(redis_server.port),
        "GPUPOOL_MAIN_SERVER_REDIS_PASSWORD": redis_server.password,
        "GPUPOOL_DATA_DIR": str(top / "data"),
        "GPUPOOL_WORKER_REMOTE_PROCESSORS": "1",
        "GPUPOOL_METRICS_LISTEN": "127.0.0.1:0",
        **s3_env,
    }
    argv = as_uid(WORKER_UID, [sys.executable, "-m", "daemon.main", "--worker"], top / "ns")
    log = top / "worker.log"
    try:
        with open(log, "wb") as out, subprocess.Popen(argv, env=env, stderr=out) as proc:
            try:
                yield
            finally:
                proc.terminate()
                proc.wait(30)
    except BaseException:
        sys.stderr.write(log.read_text(errors="replace"))
        raise
    finally:
        shutil.rmtree(top, ignore_errors=True)


async def said(queue: JobQueue, info: JobInfo) -> str:
    """What the job wrote (the worker's own `[gpupool]` notes left out)."""
    log = b"".join(data for _, data in await queue.read_log(info.id)).decode()
    return "".join(line for line in log.splitlines(keepends=True) if not line.startswith("[gpupool]"))


async def test_a_job_cannot_change_the_input_the_next_users_job_reads(
    redis_server: EmbeddedRedis, queue: JobQueue, s3_env: dict[str, str]
) -> None:
    """issue 44 item 2: on a worker not running as root the job's uid is the worker's, which owns
    the cache's inodes; an input that was a hard link to its cache entry could be made writable
    and overwritten, and the next user's job, a cache hit, read the poisoned bytes. Each job now
    gets an inode of its own: alice's overwrite changes her copy alone."""
    true = b"the true bytes\n"
    sha = hashlib.sha256(true).hexdigest()
    async with S3Store(*(s3_env[f"GPUPOOL_MAIN_SERVER_MINIO_{n}"] for n in S3_NAMES)) as store:
        await store.put_bytes(content_key(sha), true)
    inputs = ({"sha256": sha, "dest": "data.bin", "kind": "file"},)
    attack = "id -u; chmod u+w data.bin && printf poisoned > data.bin; cat data.bin; echo"
    alices, _ = await queue.enqueue(sh(attack, inputs=inputs, user="alice"))
    bobs, _ = await queue.enqueue(sh("cat data.bin", inputs=inputs, user="bob"))
    with worker_as_plain_uid(redis_server, s3_env):
        ended = (JobState.SUCCEEDED, JobState.FAILED)
        alice = await wait_state(queue, alices, *ended)
        bob = await wait_state(queue, bobs, *ended)
    alice_said, bob_said = await said(queue, alice), await said(queue, bob)
    assert alice.state is JobState.SUCCEEDED, alice_said
    assert alice_said.split() == [str(WORKER_UID), "poisoned"]  # the attack ran, on her own copy
    assert bob.state is JobState.SUCCEEDED, bob_said
    assert bob_said.encode() == true  # a cache hit: bob reads the verified bytes
