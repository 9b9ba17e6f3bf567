"""The worker cache: one download per object, shared by concurrent fetchers, LRU under a size cap."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

from storage.base import ChecksumMismatch
from storage.cache import ObjectCache
from storage.content import content_key
from tests.storage.conftest import Backend

KB = 1024


async def stored(backend: Backend, data: bytes) -> str:
    sha = hashlib.sha256(data).hexdigest()
    await backend.store.put_bytes(content_key(sha), data)
    return sha


async def test_second_fetch_is_a_hit(backend: Backend, tmp_path: Path) -> None:
    data = os.urandom(100 * KB)
    sha = await stored(backend, data)
    cache = ObjectCache(tmp_path / "cache", backend.store, max_bytes=10**9)
    first = await cache.fetch(sha)
    second = await cache.fetch(sha)
    assert first == second
    assert first.read_bytes() == data
    assert cache.downloads == 1
    assert sha in cache
    # The cache outlives the process: a worker restarted on the same directory still hits.
    again = ObjectCache(tmp_path / "cache", backend.store, max_bytes=10**9)
    assert await again.fetch(sha) == first
    assert again.downloads == 0


async def test_concurrent_fetches_download_once(backend: Backend, tmp_path: Path) -> None:
    sha = await stored(backend, os.urandom(300 * KB))
    # Two caches on one directory behave like two worker processes: separate in-process
    # single-flight maps, so only the lock file keeps them from downloading twice.
    one = ObjectCache(tmp_path / "cache", backend.store, max_bytes=10**9)
    two = ObjectCache(tmp_path / "cache", backend.store, max_bytes=10**9)
    paths = await asyncio.gather(*(c.fetch(sha) for c in [one, two] * 4))
    assert len(set(paths)) == 1
    assert one.downloads + two.downloads == 1
    assert os.listdir(tmp_path / "cache" / "tmp") == []


async def test_one_waiter_cancelled_others_still_served(backend: Backend, tmp_path: Path) -> None:
    sha = await stored(backend, os.urandom(200 * KB))
    cache = ObjectCache(tmp_path / "cache", backend.store, max_bytes=10**9)
    impatient = asyncio.ensure_future(cache.fetch(sha))
    patient = asyncio.ensure_future(cache.fetch(sha))
    await asyncio.sleep(0)
    impatient.cancel()
    assert (await patient).exists()
    assert cache.downloads == 1
    await cache.close()


async def test_lru_eviction_respects_cap(backend: Backend, tmp_path: Path) -> None:
    shas = [await stored(backend, bytes([i]) * (100 * KB)) for i in range(4)]
    a, b, c, d = shas
    cache = ObjectCache(tmp_path / "cache", backend.store, max_bytes=3 * 100 * KB)
    for sha in (a, b, c):
        await cache.fetch(sha)
    await cache.fetch(a)  # a is now more recently used than b
    await cache.fetch(d)  # over the cap: the least recently used (b) goes
    assert (a in cache, b in cache, c in cache, d in cache) == (True, False, True, True)
    assert cache.size() <= cache.max_bytes
    assert cache.downloads == 4
    await cache.fetch(b)  # back again: a download, and now c is the oldest
    assert cache.downloads == 5
    assert c not in cache
    assert cache.size() <= cache.max_bytes


async def test_pinned_and_placed_objects_survive_eviction(backend: Backend, tmp_path: Path) -> None:
    a = await stored(backend, b"a" * 100 * KB)
    b = await stored(backend, b"b" * 100 * KB)
    cache = ObjectCache(tmp_path / "cache", backend.store, max_bytes=100 * KB)
    job = tmp_path / "job" / "inputs" / "data.bin"
    async with cache.use(a) as path:
        await cache.place(a, job)
        await cache.fetch(b)  # would evict a, but a is in use
        assert path.exists()
        assert a in cache
    # Unpinned, a is the least recently used and goes; the job's hard link keeps its bytes.
    assert a not in cache
    assert b in cache
    assert cache.size() <= cache.max_bytes
    assert job.read_bytes() == b"a" * 100 * KB
    assert os.stat(job).st_mode & 0o222 == 0  # read-only, like the cache entry it was linked from


async def test_wrong_content_not_cached(backend: Backend, tmp_path: Path) -> None:
    sha = hashlib.sha256(b"what the name promises").hexdigest()
    await backend.store.put_bytes(content_key(sha), b"something else entirely")
    cache = ObjectCache(tmp_path / "cache", backend.store, max_bytes=10**9)
    with pytest.raises(ChecksumMismatch):
        await cache.fetch(sha)
    assert sha not in cache
    assert os.listdir(tmp_path / "cache" / "tmp") == []
