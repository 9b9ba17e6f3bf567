"""The object store over a local directory: the embedded single-machine default.

Layout under `root`:

    data/<key>          the object's bytes
    meta/<key>.json     {"size", "sha256", "metadata"}: a sidecar file, so no xattr support is needed
    tmp/                where writes are staged; same filesystem, so publishing is one rename

A write goes to a temp file (hashed while written), then the sidecar is renamed into place, then
the data; a reader therefore sees the whole old object or the whole new one, never a torn file.
A conditional write publishes with `os.link`, which fails atomically when the key exists.
All blocking file work runs in worker threads so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import os
import tempfile
from collections.abc import AsyncIterable, Mapping
from pathlib import Path
from typing import Any

from storage.base import (
    ChecksumMismatch,
    ObjectExists,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    StorageError,
    check_key,
    check_metadata,
)
from storage.content import CHUNK


class LocalStore(ObjectStore):
    """`ObjectStore` over the directory `root` (created on `open`)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.location = str(self.root)
        self._data = self.root / "data"
        self._meta = self.root / "meta"
        self._tmp = self.root / "tmp"

    async def open(self) -> None:
        for d in (self._data, self._meta, self._tmp):
            d.mkdir(parents=True, exist_ok=True)

    # -- paths and sidecars ------------------------------------------------------------------

    def data_path(self, key: str) -> Path:
        """Where the bytes of `key` live (tests corrupt objects through it)."""
        return self._data / check_key(key)

    def _meta_path(self, key: str) -> Path:
        return self._meta / f"{check_key(key)}.json"

    def _read_meta(self, key: str) -> dict[str, Any]:
        try:
            with open(self._meta_path(key), "rb") as f:
                meta: dict[str, Any] = json.load(f)
        except FileNotFoundError:
            return {}
        return meta

    def _stage(self) -> tuple[int, Path]:
        fd, name = tempfile.mkstemp(dir=self._tmp, prefix="put-")
        return fd, Path(name)

    def _publish(self, key: str, tmp: Path, info: ObjectInfo, if_absent: bool) -> None:
        """Move a finished temp file to `key`, sidecar first (see the module docstring)."""
        data = self.data_path(key)
        data.parent.mkdir(parents=True, exist_ok=True)
        meta = self._meta_path(key)
        meta.parent.mkdir(parents=True, exist_ok=True)
        if if_absent:
            try:
                os.link(tmp, data)
            except FileExistsError:
                raise ObjectExists(key) from None
        mfd, mtmp = self._stage()
        with os.fdopen(mfd, "w") as f:
            json.dump({"size": info.size, "sha256": info.sha256, "metadata": dict(info.metadata)}, f)
        os.replace(mtmp, meta)
        if if_absent:
            tmp.unlink()
        else:
            os.replace(tmp, data)

    # -- writes --------------------------------------------------------------------------------

    def _copy_in(self, src: Path) -> tuple[Path, int, str]:
        fd, tmp = self._stage()
        h = hashlib.sha256()
        size = 0
        try:
            with open(src, "rb") as s, os.fdopen(fd, "wb") as d:
                while chunk := s.read(CHUNK):
                    h.update(chunk)
                    d.write(chunk)
                    size += len(chunk)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp, size, h.hexdigest()

    def _finish_put(
        self,
        key: str,
        *,
        tmp: Path,
        size: int,
        got: str,
        sha256: str | None,
        metadata: dict[str, str],
        if_absent: bool,
    ) -> ObjectInfo:
        try:
            if sha256 is not None and sha256 != got:
                raise ChecksumMismatch(key, sha256, got)
            info = ObjectInfo(key, size, got, metadata)
            self._publish(key, tmp, info, if_absent)
        finally:
            tmp.unlink(missing_ok=True)
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
        check_key(key)
        meta = check_metadata(metadata)
        tmp, size, got = await asyncio.to_thread(self._copy_in, Path(path))
        return await asyncio.to_thread(
            functools.partial(self._finish_put, key, tmp=tmp, size=size, got=got, sha256=sha256),
            metadata=meta,
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
        check_key(key)
        meta = check_metadata(metadata)
        fd, tmp = self._stage()
        h = hashlib.sha256()
        size = 0
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in chunks:
                    # One thread hop per chunk both hashes and writes: neither blocks the loop.
                    await asyncio.to_thread(_hash_and_write, h, f, chunk)
                    size += len(chunk)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return await asyncio.to_thread(
            functools.partial(self._finish_put, key, tmp=tmp, size=size, got=h.hexdigest(), sha256=sha256),
            metadata=meta,
            if_absent=if_absent,
        )

    # -- reads -----------------------------------------------------------------------------------

    def _head(self, key: str) -> ObjectInfo:
        try:
            st = self.data_path(key).stat()
        except FileNotFoundError:
            raise ObjectNotFound(key) from None
        meta = self._read_meta(key)
        return ObjectInfo(key, st.st_size, meta.get("sha256"), meta.get("metadata", {}))

    def _copy_out(self, key: str, dest: Path) -> ObjectInfo:
        info = self._head(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        tmp = Path(name)
        h = hashlib.sha256()
        size = 0
        try:
            with open(self.data_path(key), "rb") as s, os.fdopen(fd, "wb") as d:
                while chunk := s.read(CHUNK):
                    h.update(chunk)
                    d.write(chunk)
                    size += len(chunk)
            got = h.hexdigest()
            if info.sha256 is not None and got != info.sha256:
                raise ChecksumMismatch(key, info.sha256, got)
            os.replace(tmp, dest)
        except FileNotFoundError:
            raise ObjectNotFound(key) from None  # deleted between head and open
        finally:
            tmp.unlink(missing_ok=True)
        return ObjectInfo(key, size, got, info.metadata)

    async def get_file(self, key: str, dest: Path) -> ObjectInfo:
        return await asyncio.to_thread(self._copy_out, key, Path(dest))

    def _read(self, key: str) -> bytes:
        info = self._head(key)
        try:
            data = self.data_path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(key) from None
        got = hashlib.sha256(data).hexdigest()
        if info.sha256 is not None and got != info.sha256:
            raise ChecksumMismatch(key, info.sha256, got)
        return data

    async def get_bytes(self, key: str) -> bytes:
        return await asyncio.to_thread(self._read, key)

    async def head(self, key: str) -> ObjectInfo:
        return await asyncio.to_thread(self._head, key)

    def _list(self, prefix: str) -> list[ObjectInfo]:
        # Walk only the directory the prefix names (`a/b/c` → data/a/b), then filter by string
        # prefix, which is S3's meaning of a prefix.
        base = self._data / prefix.rpartition("/")[0] if "/" in prefix else self._data
        out: list[ObjectInfo] = []
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                path = Path(dirpath) / name
                key = path.relative_to(self._data).as_posix()
                if key.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        st = path.stat()
                        out.append(ObjectInfo(key, st.st_size, modified=st.st_mtime))
        return sorted(out, key=lambda o: o.key)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await asyncio.to_thread(self._list, prefix)

    def _delete(self, key: str) -> None:
        for path, top in ((self.data_path(key), self._data), (self._meta_path(key), self._meta)):
            path.unlink(missing_ok=True)
            # Prune directories the key left empty so listings and the tree stay small.
            parent = path.parent
            while parent != top:
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent

    async def delete(self, key: str) -> None:
        check_key(key)
        await asyncio.to_thread(self._delete, key)

    async def presign_get(self, key: str, expires: int = 3600) -> str | None:
        return None  # same machine: transfers go through this store object

    async def presign_put(self, key: str, expires: int = 3600, sha256: str | None = None) -> str | None:
        return None


def _hash_and_write(h: Any, f: Any, chunk: bytes) -> None:
    h.update(chunk)
    if f.write(chunk) != len(chunk):
        raise StorageError("short write to the local store")
