"""Data integrity end to end (issue 14, finding 7, and content addresses through jobs): a user
uploads only to a staging key of their own; the server hashes what arrived before it publishes it
under its content key, so no one can squat a content key with other bytes; knowing a sha256 is
not having the data, neither to skip an upload nor to name it as a job's input.

Real server, real SeaweedFS, presigned PUTs over HTTP exactly as poolctl sends them."""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from daemon.client.pool_client import ClientError
from daemon.object_store import owners_prefix, upload_key
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.server.data_desk import STALE_UPLOAD_SECONDS, prune_staged
from protocol import Enqueue, Enqueued, ErrorCode, FinishUpload, ObjectRef, PrepareUpload, UploadTicket
from storage.content import content_key
from storage.s3 import S3Store
from tests.support.pool import Pool, running_pool
from tests.support.s3server import S3Server

REAL = b"alice's real training data"
EVIL = b"bob's poisoned bytes"
SHA = hashlib.sha256(REAL).hexdigest()


@pytest.fixture
async def s3_pool(redis_server: EmbeddedRedis, tmp_path: Path, s3_server: S3Server) -> AsyncIterator[Pool]:
    store = S3Store(
        s3_server.endpoint.removeprefix("http://"),
        f"u-{secrets.token_hex(6)}",
        s3_server.access_key,
        s3_server.secret_key,
    )
    await store.open()
    await store.ensure_bucket()
    await store.close()
    async with running_pool(
        redis_server, tmp_path, store=store, users=("alice", "bob", "root"), admins=("root",)
    ) as p:
        yield p


async def put(url: str, data: bytes, sha256: str) -> None:
    headers = {"x-amz-meta-sha256": sha256, "Content-Length": str(len(data))}
    async with aiohttp.ClientSession() as s, s.put(url, data=data, headers=headers) as r:
        assert r.status < 300, await r.text()


async def upload(pool: Pool, user: str, data: bytes, sha256: str, name: str | None = None) -> ObjectRef:
    async with pool.client(user) as c:
        ticket = await c.call(PrepareUpload(sha256, len(data)), UploadTicket)
        if not ticket.exists:
            assert ticket.url is not None
            await put(ticket.url, data, sha256)
        return await c.call(FinishUpload(sha256, "file", name), ObjectRef)


async def test_a_content_key_cannot_be_squatted_with_other_bytes(s3_pool: Pool) -> None:
    """Bob learnt the sha256 of data alice has not uploaded yet, and PUTs his own bytes as it."""
    async with s3_pool.client("bob") as bob:
        ticket = await bob.call(PrepareUpload(SHA, len(EVIL)), UploadTicket)
        assert ticket.url is not None
        assert ticket.key != content_key(SHA)  # his own staging key, never the content key
        await put(ticket.url, EVIL, SHA)
        with pytest.raises(ClientError) as err:
            await bob.call(FinishUpload(SHA, "file", "imagenet"), ObjectRef)
    assert err.value.code == ErrorCode.INVALID_ARGUMENT
    assert "not to the sha256" in err.value.message
    store = s3_pool.server.store
    assert store is not None
    assert not await store.exists(content_key(SHA))
    assert not await store.exists(ticket.key)  # removed
    ref = await upload(s3_pool, "alice", REAL, SHA, "imagenet")  # her upload is not blocked
    assert ref.sha256 == SHA
    assert await store.get_bytes(content_key(SHA)) == REAL


async def test_knowing_a_sha256_neither_skips_the_upload_nor_reads_the_data(s3_pool: Pool) -> None:
    await upload(s3_pool, "alice", REAL, SHA)
    spec = {"argv": ["cat", "data"], "inputs": [{"dest": "data", "sha256": SHA, "kind": "file"}]}
    async with s3_pool.client("bob") as bob:
        ticket = await bob.call(PrepareUpload(SHA, len(REAL)), UploadTicket)
        assert not ticket.exists  # stored, but not by him: he must send the bytes too
        with pytest.raises(ClientError) as err:  # and claiming it without them fails
            await bob.call(FinishUpload(SHA, "file", None), ObjectRef)
        assert err.value.code == ErrorCode.NOT_FOUND
        with pytest.raises(ClientError) as err:
            await bob.call(Enqueue(spec, None), Enqueued)
        assert err.value.code == ErrorCode.PERMISSION_DENIED
        assert "not uploaded" in err.value.message
    async with s3_pool.client("alice") as alice:
        assert (await alice.call(Enqueue(spec, None), Enqueued)).created
    async with s3_pool.client("root") as admin:  # an admin's job may take any data
        assert (await admin.call(Enqueue(spec, None), Enqueued)).created
    await upload(s3_pool, "bob", REAL, SHA)  # with the bytes he is an owner too
    async with s3_pool.client("bob") as bob:
        assert (await bob.call(Enqueue(spec, None), Enqueued)).created
        assert (await bob.call(PrepareUpload(SHA, len(REAL)), UploadTicket)).exists


async def test_data_stored_before_owners_were_recorded_still_serves(s3_pool: Pool) -> None:
    store = s3_pool.server.store
    assert store is not None
    await store.put_bytes(content_key(SHA), REAL)  # as an older server stored it: no owner
    assert await store.list(owners_prefix(SHA)) == []
    spec = {"argv": ["cat", "data"], "inputs": [{"dest": "data", "sha256": SHA, "kind": "file"}]}
    async with s3_pool.client("bob") as bob:
        assert (await bob.call(Enqueue(spec, None), Enqueued)).created


async def test_staged_uploads_never_finished_are_pruned_and_others_kept(s3_server: S3Server) -> None:
    """A client that PUT its bytes and never sent FinishUpload leaves them under `uploads/`,
    where nothing else would ever remove them: the server's prune does, once they are stale."""
    store = S3Store(f"127.0.0.1:{s3_server.port}", "gpupool", s3_server.access_key, s3_server.secret_key)
    await store.open()
    try:
        await store.ensure_bucket()
        staged, kept = upload_key("alice", "a" * 64), content_key("b" * 64)
        await store.put_bytes(staged, b"abandoned")
        await store.put_bytes(kept, b"published")
        assert await prune_staged(store, time.time()) == 0  # fresh: its FinishUpload may be coming
        assert await store.exists(staged)
        assert await prune_staged(store, time.time() + STALE_UPLOAD_SECONDS + 60) == 1
        assert not await store.exists(staged)
        assert await store.exists(kept)  # only what is staged
    finally:
        await store.close()
