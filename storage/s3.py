"""The object store on S3/MinIO through aiobotocore: multipart uploads and ranged parallel downloads.

Theory of operation:

- **Upload.** Bytes are cut into parts of `part_size`. A source that fits in one part is sent with a
  single PUT. Otherwise a multipart upload is created and up to `concurrency` parts are in flight;
  a semaphore is taken *before* the next part is read, so memory is bounded by
  `concurrency x part_size` whatever the object size. Parts are hashed in order as they are read,
  so the sha256 is computed while uploading. Each part retries with exponential backoff. On any
  failure or cancellation the in-flight parts are cancelled and the upload is aborted, leaving no
  orphaned parts behind.
- **Checksum.** The sha256 is stored as user metadata (`x-amz-meta-sha256`). S3 fixes metadata
  when the upload is created, so `put_file` hashes the file first when the caller did not pass
  the hash, then verifies the upload's own running hash against it (a file changed mid-upload is
  a ChecksumMismatch and the upload is aborted). A stream of unknown hash gets its metadata set
  after completion by a server-side copy onto itself (no bytes come back through us).
- **Download.** `head` gives the size and sha256; ranged GETs of `part_size` run `concurrency` at
  a time in an ordered pipeline: each finished part is hashed and written at its offset in a
  temp file next to the destination, then renamed into place once the hash matches. A mismatch
  removes the partial file and raises ChecksumMismatch.
- **Retries** are ours (per part, with backoff); botocore's own are reduced to one attempt so the
  two do not multiply.

Over ~400 lines on purpose: upload, download and their retries share one client, one semaphore
discipline and one error mapping; they are one object store.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import random
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from aiobotocore.session import get_session
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from storage.base import (
    SHA256_META,
    BucketUnavailable,
    ChecksumMismatch,
    ObjectExists,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    StorageError,
    TransferFailed,
    check_key,
    check_metadata,
)
from storage.content import CHUNK, sha256_file
from storage.multipart import MAX_PARTS, MultipartUpload, rechunk

log = logging.getLogger(__name__)

T = TypeVar("T")
MiB = 1024 * 1024
MIN_PART_SIZE = 5 * MiB  # S3's floor for every part but the last
MAX_COPY_SIZE = 5 * 1024 * MiB  # largest object a single CopyObject may copy

_TRANSIENT_CODES = {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "503", "500"}
_NETWORK_ERRORS: tuple[type[BaseException], ...] = (
    EndpointConnectionError,
    ConnectionClosedError,
    ConnectTimeoutError,
    ReadTimeoutError,
    ResponseStreamingError,
    IncompleteReadError,
    aiohttp.ClientError,
    asyncio.TimeoutError,
    ConnectionError,
)


def error_code(e: BaseException) -> str:
    """The S3 error code of a ClientError ('NoSuchKey', '404', …), '' for anything else."""
    if isinstance(e, ClientError):
        return str(e.response.get("Error", {}).get("Code", ""))
    return ""


def is_transient(e: BaseException) -> bool:
    """Worth retrying: network trouble or a 5xx/throttling answer. 4xx answers are final."""
    if isinstance(e, ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return error_code(e) in _TRANSIENT_CODES or int(status) >= 500
    return isinstance(e, _NETWORK_ERRORS)


class S3Store(ObjectStore):
    """`ObjectStore` on one S3/MinIO bucket.

    `endpoint` is `host:port` (the `main_server_minio_address` form; `secure` picks https) or a
    full URL. Addressing is path-style, which MinIO and SeaweedFS need without wildcard DNS.
    """

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        access_key: str,
        secret_key: str,
        *,
        secure: bool = False,
        region: str = "us-east-1",
        part_size: int = 16 * MiB,
        concurrency: int = 4,
        retries: int = 4,
        backoff: float = 0.25,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
    ) -> None:
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {MIN_PART_SIZE} bytes (the S3 minimum)")
        if concurrency < 1 or retries < 0:
            raise ValueError("concurrency must be >= 1 and retries >= 0")
        if "://" not in endpoint:
            endpoint = f"{'https' if secure else 'http'}://{endpoint}"
        self.endpoint = endpoint.rstrip("/")
        self.bucket = bucket
        self.location = f"s3 {self.endpoint}/{bucket}"
        self.part_size = part_size
        self.concurrency = concurrency
        self.retries = retries
        self.backoff = backoff
        self._access_key = access_key
        self._secret_key = secret_key
        self._region = region
        self._config = Config(
            s3={"addressing_style": "path"},
            # SigV4 everywhere, presigned URLs included (botocore would presign with SigV2).
            signature_version="s3v4",
            retries={"max_attempts": 1, "mode": "standard"},
            max_pool_connections=concurrency + 4,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            # We verify our own end-to-end sha256; botocore's default CRC trailers would only cost
            # time and are not understood by every S3 clone.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: Any = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        if self._client is not None:
            return
        stack = contextlib.AsyncExitStack()
        self._client = await stack.enter_async_context(
            get_session().create_client(
                "s3",
                endpoint_url=self.endpoint,
                region_name=self._region,
                aws_access_key_id=self._access_key,
                aws_secret_access_key=self._secret_key,
                config=self._config,
            )
        )
        self._stack = stack

    async def close(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    @property
    def client(self) -> Any:
        """The aiobotocore client (open)."""
        if self._client is None:
            raise StorageError(f"{self.location}: store is not open (use `async with store`)")
        return self._client

    async def wait_for_bucket(self, ping_timeout: float) -> None:
        """Retry until the bucket answers, for at most `ping_timeout` seconds, then raise
        BucketUnavailable naming the endpoint and bucket (`main_server_minio_bucket_ping_timeout`)."""
        deadline = time.monotonic() + ping_timeout
        delay = 0.1
        reason = "no answer"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BucketUnavailable(self.endpoint, self.bucket, f"{reason} after {ping_timeout:g} s")
            try:
                async with asyncio.timeout(left):
                    await self.client.head_bucket(Bucket=self.bucket)
            except (ClientError, BotoCoreError, *_NETWORK_ERRORS) as e:
                # An attempt cut short by the deadline must not hide what the server last said.
                if not isinstance(e, asyncio.TimeoutError) or reason == "no answer":
                    reason = self._describe(e)
                log.debug("bucket %s at %s not ready: %s", self.bucket, self.endpoint, reason)
            else:
                return
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 2.0)

    async def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (server start, tests)."""
        try:
            await self.client.create_bucket(Bucket=self.bucket)
        except ClientError as e:
            if error_code(e) not in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:
                raise BucketUnavailable(self.endpoint, self.bucket, self._describe(e)) from e

    def _describe(self, e: BaseException) -> str:
        if isinstance(e, ClientError):
            code = error_code(e)
            if code in {"404", "NoSuchBucket"}:
                return "the bucket does not exist"
            if code in {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"}:
                return f"access denied ({code}): check the access key and secret"
            return f"{code}: {e.response.get('Error', {}).get('Message', '')}".strip()
        if isinstance(e, asyncio.TimeoutError):
            return "timed out"
        return f"{type(e).__name__}: {e}"

    # -- retries and error mapping ------------------------------------------------------------

    async def retry(self, what: str, op: Callable[[], Awaitable[T]], key: str = "") -> T:
        """Run `op`, retrying transient failures with exponential backoff and jitter; then map
        the error to a StorageError (ObjectNotFound, ObjectExists when `key` is given)."""
        for attempt in range(self.retries + 1):
            try:
                return await op()
            except (ClientError, *_NETWORK_ERRORS) as e:
                if not is_transient(e) or attempt == self.retries:
                    raise self._map(e, what, key) from e
                pause = self.backoff * 2**attempt * (0.5 + random.random())
                log.warning("%s failed (%s); retry %d in %.2f s", what, self._describe(e), attempt + 1, pause)
                await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    def _map(self, e: BaseException, what: str, key: str = "") -> StorageError:
        code = error_code(e)
        if code in {"NoSuchKey", "404", "NotFound"} and key:
            return ObjectNotFound(key)
        if code == "NoSuchBucket":
            return BucketUnavailable(self.endpoint, self.bucket, "the bucket does not exist")
        if code in {"PreconditionFailed", "412"} and key:
            return ObjectExists(key)
        return TransferFailed(f"{self.location}: {what} failed: {self._describe(e)}")

    # -- uploads ------------------------------------------------------------------------------

    def part_size_for(self, size: int) -> int:
        """`part_size`, grown for huge files so they fit S3's limit of 10,000 parts."""
        need = -(-size // MAX_PARTS)
        return max(self.part_size, -(-need // MiB) * MiB)

    async def put_file(
        self,
        key: str,
        path: Path,
        *,
        sha256: str | None = None,
        metadata: Mapping[str, str] | None = None,
        if_absent: bool = False,
    ) -> ObjectInfo:
        path = Path(path)
        size = path.stat().st_size
        part = self.part_size_for(size)
        if size > part and sha256 is None:
            # Metadata is fixed when a multipart upload is created: hash first (disk is much faster
            # than the network), then check the upload's own running hash against this one.
            sha256 = await asyncio.to_thread(sha256_file, path)
        f = await asyncio.to_thread(open, path, "rb")
        with f:
            return await self._put(
                key,
                _read_file(f, part),
                part_size=part,
                sha256=sha256,
                metadata=metadata,
                if_absent=if_absent,
            )

    async def put_stream(
        self,
        key: str,
        chunks: AsyncIterable[bytes],
        *,
        sha256: str | None = None,
        metadata: Mapping[str, str] | None = None,
        if_absent: bool = False,
    ) -> ObjectInfo:
        return await self._put(
            key, chunks, part_size=self.part_size, sha256=sha256, metadata=metadata, if_absent=if_absent
        )

    async def _put(
        self,
        key: str,
        chunks: AsyncIterable[bytes],
        *,
        part_size: int,
        sha256: str | None,
        metadata: Mapping[str, str] | None,
        if_absent: bool,
    ) -> ObjectInfo:
        check_key(key)
        meta = check_metadata(metadata)
        parts = rechunk(chunks, part_size)
        try:
            head = [await anext(parts, b"")]
            second = await anext(parts, None)
            if second is None:
                return await self._put_single(key, head.pop(), sha256, meta, if_absent)
            head.append(second)
            del second  # `head` holds the only references; the upload drops them as parts go out
            upload = MultipartUpload(self, key, meta, sha256, if_absent)
            info = await upload.run(head, parts)
        finally:
            await parts.aclose()
        if sha256 is None:
            await self._set_sha256(key, info)
        return info

    async def _put_single(
        self, key: str, data: bytes, sha256: str | None, meta: dict[str, str], if_absent: bool
    ) -> ObjectInfo:
        got = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
        if sha256 is not None and got != sha256:
            raise ChecksumMismatch(key, sha256, got)
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        await self.retry(
            f"PUT {key}",
            lambda: self.client.put_object(
                Bucket=self.bucket, Key=key, Body=data, Metadata={**meta, SHA256_META: got}, **extra
            ),
            key,
        )
        return ObjectInfo(key, len(data), got, meta)

    async def _set_sha256(self, key: str, info: ObjectInfo) -> None:
        """Attach the sha256 learnt at the end of a stream, by a server-side copy onto itself."""
        await self._copy(key, key, info)

    async def _copy(self, src: str, key: str, info: ObjectInfo) -> None:
        """Copy `src` to `key` on the store's side, with `info`'s metadata and sha256."""
        metadata = {**info.metadata, SHA256_META: str(info.sha256)}
        source = {"Bucket": self.bucket, "Key": src}
        if info.size <= MAX_COPY_SIZE:
            await self.retry(
                f"COPY {src} -> {key}",
                lambda: self.client.copy_object(
                    Bucket=self.bucket,
                    Key=key,
                    CopySource=source,
                    Metadata=metadata,
                    MetadataDirective="REPLACE",
                ),
                key,
            )
        else:
            copy = MultipartUpload(self, key, dict(info.metadata), info.sha256, False)
            await copy.copy_from(source, info.size, self.part_size_for(info.size))

    async def adopt(self, staged: str, key: str, sha256: str) -> ObjectInfo:
        """The object's bytes are read back once and hashed, here; then copied on the store's
        side (no second transfer) with the sha256 it now provably has."""
        try:
            info = await self.head(staged)
            h = hashlib.sha256()
            ranges = self._ranges(staged, info.size)
            try:
                async for _, data in ranges:
                    await asyncio.to_thread(h.update, data)
            finally:
                await ranges.aclose()
            if h.hexdigest() != sha256:
                raise ChecksumMismatch(staged, sha256, h.hexdigest())
            with contextlib.suppress(ObjectNotFound):
                return await self.head(key)  # stored already: never overwritten
            verified = ObjectInfo(staged, info.size, sha256, {})
            await self._copy(staged, key, verified)
            return ObjectInfo(key, info.size, sha256, {})
        finally:
            await self.delete(staged)

    # -- downloads ----------------------------------------------------------------------------

    async def head(self, key: str) -> ObjectInfo:
        check_key(key)
        r = await self.retry(f"HEAD {key}", lambda: self.client.head_object(Bucket=self.bucket, Key=key), key)
        meta = dict(r.get("Metadata", {}))
        sha = meta.pop(SHA256_META, None)
        return ObjectInfo(key, int(r["ContentLength"]), sha, meta)

    async def _get_range(self, key: str, start: int, buf: memoryview) -> None:
        """Fill `buf` with the object's bytes from `start` (one ranged GET, retried)."""
        length = len(buf)

        async def once() -> None:
            r = await self.client.get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + length - 1}"
            )
            pos = 0
            async with r["Body"] as body:
                async for chunk in body.iter_chunks(CHUNK):
                    end = pos + len(chunk)
                    if end > length:
                        raise ConnectionError(f"server sent more than the {length} bytes asked for")
                    buf[pos:end] = chunk
                    pos = end
            if pos != length:
                raise ConnectionError(f"range {start}+{length} ended after {pos} bytes")

        await self.retry(f"GET {key} bytes {start}+{length}", once, key)

    async def _ranges(self, key: str, size: int) -> AsyncGenerator[tuple[int, memoryview], None]:
        """Yield (offset, bytes) in order, with up to `concurrency` ranged GETs in flight.

        The yielded view is only valid until the consumer asks for the next one: its buffer is
        then reused. Reusing `concurrency` part buffers (instead of allocating one per part)
        bounds memory and spares the kernel mapping and zeroing fresh pages for every part.
        """
        offsets = iter(range(0, size, self.part_size))
        free: list[bytearray] = []
        pending: list[tuple[int, bytearray, asyncio.Task[None]]] = []
        try:
            while True:
                for off in offsets:
                    buf = free.pop() if free else bytearray(self.part_size)
                    view = memoryview(buf)[: min(self.part_size, size - off)]
                    pending.append((off, buf, asyncio.ensure_future(self._get_range(key, off, view))))
                    if len(pending) >= self.concurrency:
                        break
                if not pending:
                    return
                off, buf, task = pending.pop(0)
                await task
                yield off, memoryview(buf)[: min(self.part_size, size - off)]
                free.append(buf)
        finally:
            for _, _, task in pending:
                task.cancel()
            await asyncio.gather(*(t for _, _, t in pending), return_exceptions=True)

    async def get_file(self, key: str, dest: Path) -> ObjectInfo:
        info = await self.head(key)
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        tmp = Path(name)
        h = hashlib.sha256()
        try:
            os.ftruncate(fd, info.size)  # the size up front; parts land at their offsets
            ranges = self._ranges(key, info.size)
            try:
                async for off, data in ranges:
                    await asyncio.to_thread(_hash_and_pwrite, h, fd, data, off)
            finally:
                await ranges.aclose()
            got = h.hexdigest()
            if info.sha256 is not None and got != info.sha256:
                raise ChecksumMismatch(key, info.sha256, got)
            os.replace(tmp, dest)
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # a failed or cancelled download leaves no partial file
        return ObjectInfo(key, info.size, got, info.metadata)

    async def get_bytes(self, key: str) -> bytes:
        info = await self.head(key)
        buf = bytearray(info.size)
        if info.size:
            await self._get_range(key, 0, memoryview(buf))
        data = bytes(buf)
        got = hashlib.sha256(data).hexdigest()
        if info.sha256 is not None and got != info.sha256:
            raise ChecksumMismatch(key, info.sha256, got)
        return data

    # -- listing, deletion, presigning --------------------------------------------------------

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                out.extend(
                    ObjectInfo(o["Key"], int(o["Size"]), modified=o["LastModified"].timestamp())
                    for o in page.get("Contents", [])
                )
        except (ClientError, *_NETWORK_ERRORS) as e:
            raise self._map(e, f"LIST {prefix!r}") from e
        return sorted(out, key=lambda o: o.key)

    async def delete(self, key: str) -> None:
        check_key(key)
        await self.retry(f"DELETE {key}", lambda: self.client.delete_object(Bucket=self.bucket, Key=key), key)

    async def presign_get(self, key: str, expires: int = 3600) -> str | None:
        check_key(key)
        url: str = await self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=expires
        )
        return url

    async def presign_put(self, key: str, expires: int = 3600, sha256: str | None = None) -> str | None:
        check_key(key)
        params: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if sha256 is not None:
            params["Metadata"] = {SHA256_META: sha256}
        url: str = await self.client.generate_presigned_url("put_object", Params=params, ExpiresIn=expires)
        return url


async def _read_file(f: Any, size: int) -> AsyncIterator[bytes]:
    while chunk := await asyncio.to_thread(f.read, size):
        yield chunk


def _hash_and_pwrite(h: Any, fd: int, data: memoryview, offset: int) -> None:
    h.update(data)
    view = data
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
