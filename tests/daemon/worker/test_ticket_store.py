"""An agent's object store (worker/ticket_store.py) against a real SeaweedFS, with URLs presigned by
storage.s3 as the pool server signs them. The server's answer to a call is a stand-in here (this
test is of the store; the server's side, which checks each key against the attempt, has tests of
its own): it signs whatever it is asked for, as the real one does for an attempt's own keys."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from daemon.client.pool_client import ClientError
from daemon.worker.relay import AgentCalls
from daemon.worker.ticket_store import TicketStore
from protocol import ErrorCode
from storage.base import ChecksumMismatch, ObjectNotFound, StorageError
from storage.cache import ObjectCache
from storage.content import content_key
from storage.s3 import S3Store
from tests.storage.conftest import open_s3
from tests.support.s3server import S3Server

LEASE = "w1/r1.0"


class SigningServer(AgentCalls):
    """The server's answers to store_get, store_list and store_put, signed by a real S3Store."""

    def __init__(self, store: S3Store) -> None:
        self.store = store
        self.asked: list[tuple[str, str, dict[str, Any]]] = []

    async def call(
        self, lease_id: str, call: str, args: Mapping[str, Any] | None = None, within: float | None = None
    ) -> dict[str, Any]:
        args = dict(args or {})
        self.asked.append((lease_id, call, args))
        if call == "store_get":
            try:
                info = await self.store.head(args["key"])
            except ObjectNotFound:
                raise ClientError(f"no object {args['key']!r}", ErrorCode.NOT_FOUND) from None
            url = await self.store.presign_get(args["key"], expires=60)
            return {"url": url, "size": info.size, "sha256": info.sha256}
        if call == "store_list":
            objects = [await self.store.head(o.key) for o in await self.store.list(args["prefix"])]
            return {"objects": [{"key": o.key, "size": o.size, "sha256": o.sha256} for o in objects]}
        assert call == "store_put"
        return {"url": await self.store.presign_put(args["key"], expires=60, sha256=args["sha256"])}


@pytest.fixture
async def s3(s3_server: S3Server) -> AsyncIterator[S3Store]:
    store = await open_s3(s3_server)
    yield store
    await store.close()


@pytest.fixture
async def tickets(s3: S3Store, tmp_path: Path) -> AsyncIterator[TicketStore]:
    async with aiohttp.ClientSession() as http:
        yield TicketStore(SigningServer(s3), LEASE, http, tmp_path / "spool")


async def test_an_agent_moves_bytes_on_tickets_and_verifies_them(
    tickets: TicketStore, s3: S3Store, tmp_path: Path
) -> None:
    """issue 44 item 1: an agent holds no S3 key, yet reads and writes an attempt's objects on
    tickets the server signs, each asked for by the attempt's lease; what it writes carries its
    sha256 (read back through the pool's own store), and its inputs come through the ObjectCache."""
    artifact = tmp_path / "out.bin"
    artifact.write_bytes(os.urandom(3 * 2**20 + 5))
    info = await tickets.put_file("artifacts/j1/w1%2Fr1.0/out/out.bin", artifact)
    assert info.sha256 == hashlib.sha256(artifact.read_bytes()).hexdigest()
    assert (await s3.head(info.key)).sha256 == info.sha256  # the signed header went with the PUT

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(3):
            yield bytes([i]) * 2**20

    streamed = await tickets.put_stream("checkpoints/j1/w1%2Fr1.0.1/state", chunks())
    assert await s3.get_bytes(streamed.key) == b"".join(bytes([i]) * 2**20 for i in range(3))
    assert not list((tmp_path / "spool").iterdir())  # the spool is gone once sent
    await tickets.put_bytes("checkpoints/j1/w1%2Fr1.0.1.done", b"")

    listed = await tickets.list("checkpoints/j1/")
    assert [o.key for o in listed] == ["checkpoints/j1/w1%2Fr1.0.1.done", "checkpoints/j1/w1%2Fr1.0.1/state"]
    assert listed[1].sha256 == streamed.sha256
    assert (await tickets.head(info.key)).size == artifact.stat().st_size
    got = await tickets.get_file(info.key, tmp_path / "back" / "out.bin")
    assert (tmp_path / "back" / "out.bin").read_bytes() == artifact.read_bytes()
    assert got.sha256 == info.sha256
    assert await tickets.get_bytes(streamed.key) == await s3.get_bytes(streamed.key)

    data = b"a dataset\n" * 1000
    sha = hashlib.sha256(data).hexdigest()
    await s3.put_bytes(content_key(sha), data)
    cache = ObjectCache(tmp_path / "cache", tickets, 2**30)
    placed = await cache.place(sha, tmp_path / "job" / "data.txt", private=True)
    assert placed.read_bytes() == data
    assert cache.downloads == 1
    assert all(lease == LEASE for lease, _, _ in tickets.calls.asked)  # type: ignore[attr-defined]

    with pytest.raises(ObjectNotFound):
        await tickets.get_file("artifacts/j1/none", tmp_path / "none")
    assert not (tmp_path / "none").exists()


async def test_an_agent_refuses_bytes_that_are_not_what_the_ticket_says(
    tickets: TicketStore, s3: S3Store, tmp_path: Path
) -> None:
    """issue 44 item 1: a download whose bytes do not hash to the object's sha256 (changed in the
    store, or on the way) is a ChecksumMismatch and leaves nothing behind; a file that is not what
    its caller says is not sent; and removing or publishing objects is not an agent's to do."""
    key = "checkpoints/j1/w1%2Fr1.0.1/model"
    await s3.put_bytes(key, b"the real bytes")
    head = await s3.client.head_object(Bucket=s3.bucket, Key=key)
    await s3.client.put_object(Bucket=s3.bucket, Key=key, Body=b"the fake bytes", Metadata=head["Metadata"])
    with pytest.raises(ChecksumMismatch):
        await tickets.get_file(key, tmp_path / "model")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ChecksumMismatch):
        await tickets.get_bytes(key)

    path = tmp_path / "f"
    path.write_bytes(b"these bytes")
    with pytest.raises(ChecksumMismatch):
        await tickets.put_file("artifacts/j1/w1%2Fr1.0/out/f", path, sha256="0" * 64)
    with pytest.raises(StorageError, match="no metadata"):
        await tickets.put_file("artifacts/j1/w1%2Fr1.0/out/f", path, metadata={"a": "b"})
    with pytest.raises(StorageError, match="does not delete"):
        await tickets.delete(key)
    with pytest.raises(StorageError, match="does not publish"):
        await tickets.adopt("staged", key, "0" * 64)
    assert [call for _, call, _ in tickets.calls.asked] == ["store_get", "store_get"]  # type: ignore[attr-defined]
