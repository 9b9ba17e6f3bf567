"""Fixtures for storage tests: every interface test runs on both backends (fixture params).

`backend` gives the store plus the two things a test needs to reach under the interface: corrupt
an object in place, and list multipart uploads (or staged temp files) left behind.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from storage.base import ObjectStore
from storage.local import LocalStore
from storage.s3 import MiB, S3Store
from tests.support.s3server import S3Server

PART = 5 * MiB  # S3's minimum part size: multipart paths are exercised with small files


@dataclass
class Backend:
    kind: str
    store: ObjectStore
    corrupt: Callable[[str], Awaitable[None]]
    leftovers: Callable[[], Awaitable[list[str]]]


def s3_store(server: S3Server, bucket: str, **kw: Any) -> S3Store:
    kw.setdefault("part_size", PART)
    kw.setdefault("concurrency", 3)
    kw.setdefault("backoff", 0.01)
    return S3Store(
        server.endpoint.removeprefix("http://"), bucket, server.access_key, server.secret_key, **kw
    )


async def open_s3(server: S3Server, **kw: Any) -> S3Store:
    """An open S3Store on a fresh bucket of the session's SeaweedFS (close it when done)."""
    store = s3_store(server, f"t-{secrets.token_hex(6)}", **kw)
    await store.open()
    await store.ensure_bucket()
    return store


@pytest.fixture
async def s3(s3_server: S3Server) -> AsyncIterator[S3Store]:
    store = await open_s3(s3_server)
    yield store
    await store.close()


@pytest.fixture
async def local(tmp_path: Path) -> AsyncIterator[LocalStore]:
    async with LocalStore(tmp_path / "store") as store:
        yield store


def _s3_backend(store: S3Store) -> Backend:
    async def corrupt(key: str) -> None:
        # Same length, same stored sha256, different bytes: only an end-to-end check catches it.
        head = await store.client.head_object(Bucket=store.bucket, Key=key)
        size = int(head["ContentLength"])
        await store.client.put_object(
            Bucket=store.bucket, Key=key, Body=os.urandom(size), Metadata=head["Metadata"]
        )

    async def leftovers() -> list[str]:
        r = await store.client.list_multipart_uploads(Bucket=store.bucket)
        return [u["Key"] for u in r.get("Uploads", [])]

    return Backend("s3", store, corrupt, leftovers)


def _local_backend(store: LocalStore) -> Backend:
    async def corrupt(key: str) -> None:
        path = store.data_path(key)
        path.write_bytes(os.urandom(path.stat().st_size))

    async def leftovers() -> list[str]:
        return sorted(p.name for p in (store.root / "tmp").iterdir())

    return Backend("local", store, corrupt, leftovers)


@pytest.fixture(params=["s3", "local"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """Each test using this runs twice: on the real S3 endpoint and on the local directory store.

    The S3 server is asked for only by the s3 variant, so local-only runs never start it.
    """
    if request.param == "s3":
        s3 = await open_s3(request.getfixturevalue("s3_server"))
        try:
            yield _s3_backend(s3)
        finally:
            await s3.close()
    else:
        async with LocalStore(tmp_path / "store") as local:
            yield _local_backend(local)
