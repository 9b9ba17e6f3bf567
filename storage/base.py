"""The one interface every object store implements, and the errors they all raise.

Theory of operation: an object store maps a key (a relative POSIX path such as
`sha256/ab/abcd…` or `artifacts/JOB/2/out.tar`) to bytes plus a little metadata. Every object carries
the sha256 of its bytes, computed while it is written and checked again when it is read, so a
corrupted or truncated object is an error (`ChecksumMismatch`), never silently wrong data.

Two backends: `storage.s3.S3Store` (MinIO or any S3; multi-node pools) and
`storage.local.LocalStore` (a directory; the embedded single-machine default). Callers hold an
`ObjectStore` and never care which one it is (STYLE.md §9).
"""

from __future__ import annotations

import abc
import re
import tempfile
from collections.abc import AsyncIterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

# Metadata names travel as HTTP headers (x-amz-meta-NAME) on S3, so keep them to what every
# backend and proxy preserves unchanged: lowercase ASCII letters, digits and dashes.
_META_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
SHA256_META = "sha256"


class StorageError(Exception):
    """Base of every storage error: a machine-readable `code` and a sentence for the human."""

    code = "storage_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ObjectNotFound(StorageError):
    code = "object_not_found"

    def __init__(self, key: str) -> None:
        super().__init__(f"no object {key!r} in the store")
        self.key = key


class ObjectExists(StorageError):
    """A conditional write (`if_absent=True`) found the key already taken."""

    code = "object_exists"

    def __init__(self, key: str) -> None:
        super().__init__(f"object {key!r} already exists; it was not overwritten")
        self.key = key


class ChecksumMismatch(StorageError):
    code = "checksum_mismatch"

    def __init__(self, key: str, expected: str, got: str) -> None:
        super().__init__(
            f"object {key!r} has sha256 {got}, expected {expected}: "
            "the data was corrupted or changed during the transfer"
        )
        self.key = key
        self.expected = expected
        self.got = got


class BucketUnavailable(StorageError):
    code = "bucket_unavailable"

    def __init__(self, endpoint: str, bucket: str, reason: str) -> None:
        super().__init__(f"bucket {bucket!r} at {endpoint} is not available: {reason}")
        self.endpoint = endpoint
        self.bucket = bucket
        self.reason = reason


class InvalidKey(StorageError):
    code = "invalid_key"

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"invalid object key {key!r}: {reason}")
        self.key = key


class TransferFailed(StorageError):
    """A request kept failing after its retries (network, server errors)."""

    code = "transfer_failed"


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What `head` (and a finished put/get) knows about an object.

    `sha256` is None only for objects written by something other than gpupool, and in `list`
    results, which carry key, size and `modified` alone (S3 listings do not return metadata).
    """

    key: str
    size: int
    sha256: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    modified: float | None = None  # seconds since the epoch, in `list` results


def check_key(key: str) -> str:
    """Refuse keys that would mean different things on S3 and on a filesystem.

    Both backends accept the same keys, so a pool can move between them: a relative path of
    non-empty segments, no `.`/`..`, no backslashes or NULs.
    """
    if not key or len(key) > 1024:
        raise InvalidKey(key, "must be 1 to 1024 characters")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise InvalidKey(key, "must be a relative path without backslashes or NUL")
    for part in key.split("/"):
        if part in {"", ".", ".."}:
            raise InvalidKey(key, "segments must be non-empty and not '.' or '..'")
    return key


def check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """Validate user metadata; `sha256` is reserved for the store's own checksum."""
    out: dict[str, str] = {}
    for name, value in (metadata or {}).items():
        if not _META_NAME.match(name) or name == SHA256_META:
            raise StorageError(f"metadata name {name!r} must be lowercase [a-z0-9-] and not 'sha256'")
        if not value.isascii() or any(ord(c) < 32 for c in value):
            raise StorageError(f"metadata {name!r} must be printable ASCII")
        out[name] = value
    return out


class ObjectStore(abc.ABC):
    """Async object storage. Use as `async with store:` or call `open()` / `close()`."""

    #: Human description for logs and error messages ("s3 http://host:9000/bucket", a path).
    location: str

    async def open(self) -> None:  # noqa: B027 - optional hook; the local store needs none
        """Acquire connections or directories. Idempotent."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release what `open` acquired. Safe to call twice."""

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @abc.abstractmethod
    async def put_file(
        self,
        key: str,
        path: Path,
        *,
        sha256: str | None = None,
        metadata: Mapping[str, str] | None = None,
        if_absent: bool = False,
    ) -> ObjectInfo:
        """Upload the file at `path`. `sha256`, when given, is what the bytes must hash to
        (ChecksumMismatch otherwise). `if_absent` makes the write conditional: ObjectExists
        if the key is taken."""

    @abc.abstractmethod
    async def put_stream(
        self,
        key: str,
        chunks: AsyncIterable[bytes],
        *,
        sha256: str | None = None,
        metadata: Mapping[str, str] | None = None,
        if_absent: bool = False,
    ) -> ObjectInfo:
        """Upload bytes produced by an async iterator (a tar stream, generated data). Chunks
        may have any size; memory stays bounded whatever the total."""

    async def put_bytes(
        self, key: str, data: bytes, *, metadata: Mapping[str, str] | None = None, if_absent: bool = False
    ) -> ObjectInfo:
        """Upload a small in-memory object (manifests, logs)."""

        async def one() -> AsyncIterable[bytes]:
            yield data

        return await self.put_stream(key, one(), metadata=metadata, if_absent=if_absent)

    @abc.abstractmethod
    async def get_file(self, key: str, dest: Path) -> ObjectInfo:
        """Download to `dest` atomically: the file appears whole and verified, or not at all.
        Returns the info with the sha256 computed from the bytes received."""

    @abc.abstractmethod
    async def get_bytes(self, key: str) -> bytes:
        """Download a small object into memory, verified."""

    async def adopt(self, staged: str, key: str, sha256: str) -> ObjectInfo:
        """Publish the object someone uploaded to `staged` as `key`, once its bytes, read back,
        hash to `sha256` (ChecksumMismatch otherwise, and `staged` is removed either way). Never
        overwrites: where `key` exists it is kept. The uploader never writes `key` itself, so a
        content key always holds the bytes its name says. Here: downloaded and uploaded again;
        a store that can copy on its side does better."""
        with tempfile.TemporaryDirectory(prefix="gpupool-adopt-") as tmp:
            try:
                await self.get_file(staged, Path(tmp) / "object")
                try:
                    return await self.put_file(key, Path(tmp) / "object", sha256=sha256, if_absent=True)
                except ObjectExists:
                    return await self.head(key)
            finally:
                await self.delete(staged)

    @abc.abstractmethod
    async def head(self, key: str) -> ObjectInfo:
        """Size, sha256 and metadata of `key`; ObjectNotFound if absent."""

    async def exists(self, key: str) -> bool:
        """Whether `key` exists: the caller's way to skip uploading content already stored."""
        try:
            await self.head(key)
        except ObjectNotFound:
            return False
        return True

    @abc.abstractmethod
    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Objects whose key starts with `prefix`, sorted by key, with key, size and the time
        they were last written only."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove `key`; deleting an absent key is not an error."""

    @abc.abstractmethod
    async def presign_get(self, key: str, expires: int = 3600) -> str | None:
        """A URL anyone can GET for `expires` seconds, or None where the backend cannot presign
        (then the transfer goes through this store object)."""

    @abc.abstractmethod
    async def presign_put(self, key: str, expires: int = 3600, sha256: str | None = None) -> str | None:
        """A URL to PUT the object to directly, or None. With `sha256`, the uploader must send
        header `x-amz-meta-sha256: <sha256>` (it is part of the signature)."""
