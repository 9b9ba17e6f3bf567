"""The ObjectStore interface, identical on both backends: round trips, metadata, listing, errors."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from storage.base import InvalidKey, ObjectExists, ObjectNotFound
from storage.s3 import MiB, S3Store
from tests.storage.conftest import PART, Backend

SIZES = [0, 1, PART + 1, 17 * MiB]


def write_random(path: Path, size: int) -> str:
    data = os.urandom(size)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s}B")
async def test_file_round_trip(backend: Backend, tmp_path: Path, size: int) -> None:
    src = tmp_path / "src"
    sha = write_random(src, size)
    info = await backend.store.put_file("data/file", src, metadata={"name": "src"})
    assert (info.size, info.sha256) == (size, sha)
    head = await backend.store.head("data/file")
    assert (head.size, head.sha256, dict(head.metadata)) == (size, sha, {"name": "src"})
    got = await backend.store.get_file("data/file", tmp_path / "out" / "dst")
    assert got.sha256 == sha
    assert (tmp_path / "out" / "dst").read_bytes() == src.read_bytes()
    assert os.listdir(tmp_path / "out") == ["dst"]  # no temp file left beside it
    assert await backend.leftovers() == []


async def chunks(total: int, step: int) -> AsyncIterator[bytes]:
    for start in range(0, total, step):
        yield bytes([start % 251]) * min(step, total - start)


@pytest.mark.parametrize(
    ("total", "step"), [(0, 1), (1000, 7), (2 * PART + 123, 1_000_003)], ids=["empty", "small", "multipart"]
)
async def test_stream_round_trip(backend: Backend, tmp_path: Path, total: int, step: int) -> None:
    expected = b"".join([c async for c in chunks(total, step)])
    info = await backend.store.put_stream("streams/s", chunks(total, step))
    sha = hashlib.sha256(expected).hexdigest()
    assert (info.size, info.sha256) == (total, sha)
    # A stream's hash is only known at its end; the store still records it with the object.
    assert (await backend.store.head("streams/s")).sha256 == sha
    await backend.store.get_file("streams/s", tmp_path / "s")
    assert (tmp_path / "s").read_bytes() == expected
    assert await backend.store.get_bytes("streams/s") == expected


async def test_bytes_exists_list_delete(backend: Backend) -> None:
    store = backend.store
    assert not await store.exists("a/x")
    for key in ["a/x", "a/y/z", "ab", "b"]:
        await store.put_bytes(key, key.encode())
    assert await store.exists("a/x")
    assert [(o.key, o.size) for o in await store.list("a")] == [("a/x", 3), ("a/y/z", 5), ("ab", 2)]
    assert [o.key for o in await store.list("a/")] == ["a/x", "a/y/z"]
    assert [o.key for o in await store.list("a/y/")] == ["a/y/z"]
    assert len(await store.list()) == 4
    for info in await store.list():  # when each was written (what prunes staged uploads by)
        assert info.modified is not None
        assert abs(info.modified - time.time()) < 300
    assert await store.get_bytes("a/y/z") == b"a/y/z"
    await store.delete("a/y/z")
    await store.delete("a/y/z")  # deleting an absent key is fine
    assert [o.key for o in await store.list("a/")] == ["a/x"]
    with pytest.raises(ObjectNotFound) as err:
        await store.head("a/y/z")
    assert err.value.code == "object_not_found"
    assert "a/y/z" in str(err.value)


async def test_missing_object_errors(backend: Backend, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFound):
        await backend.store.get_file("nope", tmp_path / "nope")
    with pytest.raises(ObjectNotFound):
        await backend.store.get_bytes("nope")
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize("size", [10, PART + 10], ids=["single", "multipart"])
async def test_if_absent_refuses_overwrite(backend: Backend, tmp_path: Path, size: int) -> None:
    src = tmp_path / "src"
    write_random(src, size)
    await backend.store.put_file("ca/obj", src, if_absent=True)
    other = tmp_path / "other"
    write_random(other, size)
    with pytest.raises(ObjectExists):
        await backend.store.put_file("ca/obj", other, if_absent=True)
    await backend.store.get_file("ca/obj", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == src.read_bytes()
    assert await backend.leftovers() == []


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "./a", "a\\b"])
async def test_invalid_keys_refused(backend: Backend, key: str) -> None:
    with pytest.raises(InvalidKey):
        await backend.store.put_bytes(key, b"x")


async def test_presigned_urls(backend: Backend) -> None:
    store = backend.store
    if not isinstance(store, S3Store):
        assert await store.presign_get("k") is None
        assert await store.presign_put("k") is None
        return
    body = b"through a presigned url"
    sha = hashlib.sha256(body).hexdigest()
    put_url = await store.presign_put("pre/k", expires=60, sha256=sha)
    get_url = await store.presign_get("pre/k", expires=60)
    assert put_url is not None
    assert get_url is not None
    async with aiohttp.ClientSession() as http:
        async with http.put(put_url, data=body, headers={"x-amz-meta-sha256": sha}) as r:
            assert r.status == 200, await r.text()
        async with http.get(get_url) as r:
            assert r.status == 200
            assert await r.read() == body
        async with http.get(get_url.replace("Signature=", "Signature=0")) as r:
            assert r.status == 403  # the endpoint checks signatures
    assert await store.get_bytes("pre/k") == body  # sha256 metadata came with the presigned PUT
