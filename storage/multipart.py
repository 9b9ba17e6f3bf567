"""One S3 multipart upload: parts in flight under a memory bound, hashed in order, aborted on failure.

A `MultipartUpload` lives for one object. `run` is the upload proper; `copy_from` is the
server-side multipart copy used to rewrite metadata on objects too big for a single CopyObject.
Both follow one rule: once `CreateMultipartUpload` has answered, the upload is either completed
or aborted — whatever happens, including cancellation — so no orphaned parts stay behind to
be billed and listed forever.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Coroutine
from typing import TYPE_CHECKING, Any

from storage.base import SHA256_META, ChecksumMismatch, ObjectInfo, StorageError

if TYPE_CHECKING:
    from storage.s3 import S3Store

log = logging.getLogger(__name__)

MAX_PARTS = 10_000  # S3's limit per upload


async def rechunk(chunks: AsyncIterable[bytes], size: int) -> AsyncGenerator[bytes, None]:
    """Re-cut a stream into pieces of exactly `size` bytes (the last may be shorter).

    Chunks that already have the right size (file reads) pass through without a copy.
    """
    buf = bytearray()
    async for chunk in chunks:
        if not buf and len(chunk) == size:
            yield chunk
            continue
        buf += chunk
        while len(buf) >= size:
            yield bytes(buf[:size])
            del buf[:size]
    if buf:
        yield bytes(buf)


async def _chain(head: list[bytes], rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    # Pop, don't iterate: a part already handed out must not stay referenced from here, or the
    # parts peeked before the upload started would live (and count) until its end.
    while head:
        yield head.pop(0)
    async for part in rest:
        yield part


class MultipartUpload:
    def __init__(
        self, store: S3Store, key: str, metadata: dict[str, str], sha256: str | None, if_absent: bool
    ) -> None:
        self.store = store
        self.key = key
        self.metadata = metadata
        self.sha256 = sha256
        self.if_absent = if_absent
        self.upload_id = ""
        self._tasks: list[asyncio.Task[str]] = []
        self._failure: BaseException | None = None

    async def _create(self) -> None:
        s = self.store
        meta = dict(self.metadata)
        if self.sha256 is not None:
            meta[SHA256_META] = self.sha256
        r = await s.retry(
            f"create upload {self.key}",
            lambda: s.client.create_multipart_upload(Bucket=s.bucket, Key=self.key, Metadata=meta),
            self.key,
        )
        self.upload_id = r["UploadId"]

    def _spawn(self, coro: Coroutine[Any, Any, str], sem: asyncio.Semaphore) -> None:
        async def guarded() -> str:
            try:
                return await coro
            except BaseException as e:
                # Remember the first failure so the producer stops reading more parts at once.
                if self._failure is None and not isinstance(e, asyncio.CancelledError):
                    self._failure = e
                raise
            finally:
                sem.release()

        self._tasks.append(asyncio.ensure_future(guarded()))

    async def _put_part(self, number: int, data: bytes) -> str:
        s = self.store
        r = await s.retry(
            f"PUT part {number} of {self.key}",
            lambda: s.client.upload_part(
                Bucket=s.bucket, Key=self.key, UploadId=self.upload_id, PartNumber=number, Body=data
            ),
            self.key,
        )
        return str(r["ETag"])

    async def run(self, head: list[bytes], rest: AsyncIterator[bytes]) -> ObjectInfo:
        """Upload the parts in `head` (emptied as they go), then the rest; returns the info with
        the computed sha256."""
        await self._create()
        try:
            sem = asyncio.Semaphore(self.store.concurrency)
            h = hashlib.sha256()
            size = 0
            source = _chain(head, rest)
            while True:
                # The permit is taken before the next part is read: that is the memory bound.
                await sem.acquire()
                if self._failure is not None:
                    raise self._failure
                data = await anext(source, None)
                if data is None:
                    sem.release()
                    break
                if len(self._tasks) >= MAX_PARTS:
                    raise StorageError(f"{self.key}: more than {MAX_PARTS} parts; raise part_size")
                size += len(data)
                await asyncio.to_thread(h.update, data)
                self._spawn(self._put_part(len(self._tasks) + 1, data), sem)
                del data  # the task holds the only reference; freed when the part is sent
            etags = await asyncio.gather(*self._tasks)
            got = h.hexdigest()
            if self.sha256 is not None and got != self.sha256:
                raise ChecksumMismatch(self.key, self.sha256, got)
            await self._complete(etags)
        except BaseException:
            await self._abort()
            raise
        return ObjectInfo(self.key, size, got, self.metadata)

    async def copy_from(self, source: dict[str, str], size: int, part_size: int) -> None:
        """Server-side copy of `source` (same size) into this key in parts, with new metadata."""
        await self._create()
        try:
            sem = asyncio.Semaphore(self.store.concurrency)
            for number, start in enumerate(range(0, size, part_size), 1):
                await sem.acquire()
                if self._failure is not None:
                    raise self._failure
                end = min(start + part_size, size) - 1
                self._spawn(self._copy_part(number, source, f"bytes={start}-{end}"), sem)
            await self._complete(await asyncio.gather(*self._tasks))
        except BaseException:
            await self._abort()
            raise

    async def _copy_part(self, number: int, source: dict[str, str], byte_range: str) -> str:
        s = self.store
        r = await s.retry(
            f"copy part {number} of {self.key}",
            lambda: s.client.upload_part_copy(
                Bucket=s.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                PartNumber=number,
                CopySource=source,
                CopySourceRange=byte_range,
            ),
            self.key,
        )
        return str(r["CopyPartResult"]["ETag"])

    async def _complete(self, etags: list[str]) -> None:
        s = self.store
        parts = [{"ETag": etag, "PartNumber": n} for n, etag in enumerate(etags, 1)]
        extra = {"IfNoneMatch": "*"} if self.if_absent else {}
        await s.retry(
            f"complete upload {self.key}",
            lambda: s.client.complete_multipart_upload(
                Bucket=s.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
                **extra,
            ),
            self.key,
        )

    async def _abort(self) -> None:
        """Cancel parts still in flight, wait for them, then abort the upload on the server."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        s = self.store
        try:
            await s.retry(
                f"abort upload {self.key}",
                lambda: s.client.abort_multipart_upload(
                    Bucket=s.bucket, Key=self.key, UploadId=self.upload_id
                ),
            )
        except StorageError as e:
            # Nothing more can be done here; say so loudly, with what an admin needs to clean up.
            log.error("could not abort upload %s of %s: %s", self.upload_id, self.key, e)
