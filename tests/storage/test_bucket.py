"""Waiting for the bucket at worker start (`main_server_minio_bucket_ping_timeout`)."""

from __future__ import annotations

import asyncio
import secrets
import time

import pytest

from daemon.queue.embedded_redis import free_port
from storage.base import BucketUnavailable
from storage.s3 import S3Store
from tests.storage.conftest import s3_store
from tests.support.s3server import S3Server


async def test_missing_bucket_fails_with_clear_message(s3_server: S3Server) -> None:
    async with s3_store(s3_server, "never-created") as store:
        t0 = time.monotonic()
        with pytest.raises(BucketUnavailable) as err:
            await store.wait_for_bucket(1.5)
        assert time.monotonic() - t0 < 10
    msg = str(err.value)
    assert "never-created" in msg
    assert s3_server.endpoint in msg
    assert "does not exist" in msg
    assert err.value.code == "bucket_unavailable"


async def test_dead_endpoint_fails_with_clear_message() -> None:
    port = free_port()  # nothing listens there
    async with S3Store(f"127.0.0.1:{port}", "gpupool", "k", "s", connect_timeout=0.5) as store:
        with pytest.raises(BucketUnavailable) as err:
            await store.wait_for_bucket(0.5)
    msg = str(err.value)
    assert f"http://127.0.0.1:{port}" in msg
    assert "'gpupool'" in msg
    assert "0.5 s" in msg


async def test_wrong_secret_says_access_denied(s3_server: S3Server) -> None:
    store = S3Store(s3_server.endpoint, "gpupool", s3_server.access_key, "not-the-secret")
    async with store:
        with pytest.raises(BucketUnavailable, match="access denied"):
            await store.wait_for_bucket(1.5)


async def test_waits_until_the_bucket_appears(s3: S3Store, s3_server: S3Server) -> None:
    bucket = f"late-{secrets.token_hex(4)}"
    async with s3_store(s3_server, bucket) as waiting:
        waiter = asyncio.ensure_future(waiting.wait_for_bucket(20))
        await asyncio.sleep(0.3)
        assert not waiter.done()
        await s3.client.create_bucket(Bucket=bucket)
        await waiter  # returns once the bucket answers
        await waiting.ensure_bucket()  # idempotent on an existing bucket
