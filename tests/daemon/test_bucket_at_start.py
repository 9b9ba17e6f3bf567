"""A multinode server needs its bucket as a worker does (issue 47 item 11), and `poold --make-bucket`
makes it: on the real S3 fixture (SeaweedFS), with real `poold` processes."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

from daemon.queue.embedded_redis import EmbeddedRedis
from tests.support.s3server import S3Server


def test_a_server_without_its_bucket_refuses_to_start_and_make_bucket_makes_it(
    tmp_path: Path, redis_server: EmbeddedRedis, s3_server: S3Server
) -> None:
    """issue 47 item 11: a server whose bucket is absent exits 1 with one sentence naming the
    endpoint, the bucket and how to create it (it used to start and fail each upload later);
    `poold --make-bucket` with the same configuration creates it, and says where."""
    bucket = f"absent-{secrets.token_hex(4)}"
    env = dict(
        os.environ,
        XDG_CONFIG_HOME=str(tmp_path / "xdg"),
        GPUPOOL_WORKER_MODE="multinode",
        GPUPOOL_REDIS_PORT=str(redis_server.port),
        GPUPOOL_MAIN_SERVER_REDIS_PASSWORD=redis_server.password,
        GPUPOOL_MAIN_SERVER_MINIO_ADDRESS=s3_server.endpoint.removeprefix("http://"),
        GPUPOOL_MAIN_SERVER_MINIO_BUCKET=bucket,
        GPUPOOL_MAIN_SERVER_MINIO_ACCESS_KEY_ID=s3_server.access_key,
        GPUPOOL_MAIN_SERVER_MINIO_SECRET_ACCESS_KEY=s3_server.secret_key,
        GPUPOOL_MAIN_SERVER_MINIO_BUCKET_PING_TIMEOUT="0.5",
        GPUPOOL_LISTEN="127.0.0.1:0",
        GPUPOOL_METRICS_LISTEN="127.0.0.1:0",
        GPUPOOL_WEB_LISTEN="off",
        GPUPOOL_DATA_DIR=str(tmp_path / "data"),
    )
    poold = [sys.executable, "-m", "daemon.main"]
    server = subprocess.run(poold, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert server.returncode == 1, server.stderr
    said = [line for line in server.stderr.splitlines() if "object store" in line]
    assert len(said) == 1, server.stderr
    assert (
        f"the server cannot start without its object store: bucket {bucket!r} at {s3_server.endpoint} "
        "is not available: the bucket does not exist after 0.5 s; create it with `poold --make-bucket`"
    ) in said[0]
    assert "Traceback" not in server.stderr

    made = subprocess.run(
        [*poold, "--make-bucket"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert made.returncode == 0, made.stderr
    assert made.stdout == f"poold: bucket {bucket!r} at {s3_server.endpoint} is ready\n"
