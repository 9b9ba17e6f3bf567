"""End-to-end integrity: corruption detected, failed and cancelled uploads leave nothing behind."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from storage import s3 as s3_module
from storage.base import ChecksumMismatch, ObjectNotFound, TransferFailed
from storage.s3 import S3Store
from tests.storage.conftest import PART, Backend


@pytest.mark.parametrize("size", [100, 2 * PART + 5], ids=["single", "multipart"])
async def test_corruption_detected_and_partial_removed(backend: Backend, tmp_path: Path, size: int) -> None:
    src = tmp_path / "src"
    src.write_bytes(os.urandom(size))
    await backend.store.put_file("obj", src)
    await backend.corrupt("obj")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ChecksumMismatch) as err:
        await backend.store.get_file("obj", out / "dst")
    assert err.value.code == "checksum_mismatch"
    assert err.value.expected == hashlib.sha256(src.read_bytes()).hexdigest()
    assert "obj" in str(err.value)
    assert list(out.iterdir()) == []  # neither the destination nor a partial file
    with pytest.raises(ChecksumMismatch):
        await backend.store.get_bytes("obj")


@pytest.mark.parametrize("size", [100, 2 * PART + 5], ids=["single", "multipart"])
async def test_wrong_expected_sha_refused(backend: Backend, tmp_path: Path, size: int) -> None:
    src = tmp_path / "src"
    src.write_bytes(os.urandom(size))
    with pytest.raises(ChecksumMismatch):
        await backend.store.put_file("obj", src, sha256="0" * 64)
    assert not await backend.store.exists("obj")
    assert await backend.leftovers() == []


async def failing_stream(parts: int) -> AsyncIterator[bytes]:
    for _ in range(parts):
        yield os.urandom(PART)
    raise OSError("the source disk went away")


async def test_failed_source_aborts_upload(backend: Backend) -> None:
    with pytest.raises(OSError, match="went away"):
        await backend.store.put_stream("broken", failing_stream(3))
    assert not await backend.store.exists("broken")
    assert await backend.leftovers() == []  # list_multipart_uploads is empty on S3


async def test_cancelled_upload_aborts(backend: Backend) -> None:
    sent = asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield os.urandom(PART)
        sent.set()
        await asyncio.sleep(3600)  # the upload is cancelled while waiting for more data
        yield b""

    task = asyncio.ensure_future(backend.store.put_stream("cancelled", slow()))
    await asyncio.wait_for(sent.wait(), 30)
    await asyncio.sleep(0.05)  # parts in flight
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not await backend.store.exists("cancelled")
    assert await backend.leftovers() == []


def flaky(real: Any, failures: int, calls: list[int]) -> Any:
    """Wrap a client method so its first `failures` calls answer a 503, as a busy server would."""

    async def method(**kw: Any) -> Any:
        calls.append(kw.get("PartNumber", 0))
        if len(calls) <= failures:
            raise ClientError(
                {"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "UploadPart"
            )
        return await real(**kw)

    return method


async def test_part_retried_after_transient_failure(s3: S3Store, tmp_path: Path, monkeypatch: Any) -> None:
    src = tmp_path / "src"
    src.write_bytes(os.urandom(2 * PART + 1))
    calls: list[int] = []
    monkeypatch.setattr(s3.client, "upload_part", flaky(s3.client.upload_part, 2, calls))
    info = await s3.put_file("retried", src)
    assert len(calls) == 3 + 2  # three parts, two of the attempts failed and were retried
    await s3.get_file("retried", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == src.read_bytes()
    assert info.sha256 == hashlib.sha256(src.read_bytes()).hexdigest()


async def test_part_failing_for_good_aborts(s3: S3Store, tmp_path: Path, monkeypatch: Any) -> None:
    src = tmp_path / "src"
    src.write_bytes(os.urandom(4 * PART))
    calls: list[int] = []
    monkeypatch.setattr(s3.client, "upload_part", flaky(s3.client.upload_part, 10**6, calls))
    with pytest.raises(TransferFailed, match="SlowDown"):
        await s3.put_file("doomed", src)
    monkeypatch.undo()
    r = await s3.client.list_multipart_uploads(Bucket=s3.bucket)
    assert r.get("Uploads", []) == []
    with pytest.raises(ObjectNotFound):
        await s3.head("doomed")


async def test_large_stream_metadata_by_multipart_copy(s3: S3Store, monkeypatch: Any) -> None:
    # Objects over 5 GiB cannot be copied in one CopyObject; shrink the limit to test that path.
    monkeypatch.setattr(s3_module, "MAX_COPY_SIZE", PART)
    data = os.urandom(2 * PART + 7)

    async def stream() -> AsyncIterator[bytes]:
        yield data

    info = await s3.put_stream("copied", stream(), metadata={"kind": "tar"})
    head = await s3.head("copied")
    assert head.sha256 == info.sha256 == hashlib.sha256(data).hexdigest()
    assert dict(head.metadata) == {"kind": "tar"}
    assert await s3.get_bytes("copied") == data
    r = await s3.client.list_multipart_uploads(Bucket=s3.bucket)
    assert r.get("Uploads", []) == []
