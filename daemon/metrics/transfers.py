"""The bytes a worker moves to and from the object store, counted where they cross.

`MeteredStore` wraps the worker's store and tells `on_bytes(direction, nbytes)` the size of every
object that was uploaded or downloaded in full: artifacts and logs going up, snapshots and inputs
coming down. Counting at the store rather than where jobs ask for data is what makes the count
true: the worker's cache (storage/cache.py) serves an object it already holds without a download,
and two jobs wanting one object at once share one download, so a job's inputs and the bytes moved
are not the same thing. A transfer that fails counts nothing (its partial bytes are not known).

The wrapper owns nothing: `open` and `close` are left to whoever opened the store it wraps.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable, Mapping
from pathlib import Path

from storage.base import ObjectInfo, ObjectStore

# Told ("upload" or "download", bytes) after each whole transfer: WorkerMetrics.transferred.
TransferObserver = Callable[[str, int], None]


class MeteredStore(ObjectStore):
    """`store`, with every whole upload and download reported to `on_bytes`."""

    def __init__(self, store: ObjectStore, on_bytes: TransferObserver) -> None:
        self.inner = store
        self.location = store.location
        self._on_bytes = on_bytes

    def _moved(self, direction: str, info: ObjectInfo) -> ObjectInfo:
        self._on_bytes(direction, info.size)
        return info

    async def put_file(
        self,
        key: str,
        path: Path,
        *,
        sha256: str | None = None,
        metadata: Mapping[str, str] | None = None,
        if_absent: bool = False,
    ) -> ObjectInfo:
        info = await self.inner.put_file(key, path, sha256=sha256, metadata=metadata, if_absent=if_absent)
        return self._moved("upload", info)

    async def put_stream(
        self,
        key: str,
        chunks: AsyncIterable[bytes],
        *,
        sha256: str | None = None,
        metadata: Mapping[str, str] | None = None,
        if_absent: bool = False,
    ) -> ObjectInfo:
        info = await self.inner.put_stream(key, chunks, sha256=sha256, metadata=metadata, if_absent=if_absent)
        return self._moved("upload", info)

    async def put_bytes(
        self, key: str, data: bytes, *, metadata: Mapping[str, str] | None = None, if_absent: bool = False
    ) -> ObjectInfo:
        info = await self.inner.put_bytes(key, data, metadata=metadata, if_absent=if_absent)
        return self._moved("upload", info)

    async def get_file(self, key: str, dest: Path) -> ObjectInfo:
        return self._moved("download", await self.inner.get_file(key, dest))

    async def get_bytes(self, key: str) -> bytes:
        data = await self.inner.get_bytes(key)
        self._on_bytes("download", len(data))
        return data

    # Metadata only: no object's bytes cross.

    async def head(self, key: str) -> ObjectInfo:
        return await self.inner.head(key)

    async def exists(self, key: str) -> bool:
        return await self.inner.exists(key)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await self.inner.list(prefix)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def presign_get(self, key: str, expires: int = 3600) -> str | None:
        return await self.inner.presign_get(key, expires)

    async def presign_put(self, key: str, expires: int = 3600, sha256: str | None = None) -> str | None:
        return await self.inner.presign_put(key, expires, sha256)
