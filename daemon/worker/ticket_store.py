"""The object store as an agent sees it: one attempt's transfers, each on a ticket the server signs.

An agent (agent.py) holds no S3 credential. For each object one of its attempts reads or writes it
asks the pool server (`store_get`, `store_list`, `store_put`: docs/PROTOCOL.md §3.4), which signs
a URL for that attempt's own keys only (its inputs, snapshot and project, its job's checkpoints, its own
artifacts and saves), and the bytes go straight between the agent and the store over HTTP.

Data is verified end to end as every store does (storage/base.py): a download is hashed as it
arrives and must match the sha256 the server read from the object's metadata (ChecksumMismatch
otherwise, and nothing is left at the destination); an upload is hashed first, since the signed
PUT carries its size and sha256 (`x-amz-meta-sha256`), then hashed again as it is sent, so a file
changed in between is a ChecksumMismatch, never an object whose bytes and hash disagree unsaid. A
stream (a checkpoint's file, the job's log) is spooled to a temporary file in the agent's own
directory first, for the same reason. Removing or publishing objects is no attempt's to do:
`delete` and `adopt` refuse.

One `TicketStore` per attempt: it knows its lease, which every call names. The agent's
ObjectCache for that attempt's inputs runs over it (storage/cache.py: one cache directory shared
by every attempt's cache, locked per object, as two workers on one machine share one).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from daemon.client.pool_client import ClientError
from daemon.worker.pool_link import PoolUnreachable
from daemon.worker.relay import AgentCalls
from protocol import ErrorCode
from storage.base import (
    SHA256_META,
    ChecksumMismatch,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    StorageError,
    TransferFailed,
    check_key,
)
from storage.content import CHUNK

T = TypeVar("T")
TRIES = 3  # each transfer, on a network error or a 5xx answer
BACKOFF = 0.5  # seconds before the second try, doubled for the next


class TicketStore(ObjectStore):
    """`ObjectStore` for the attempt `lease_id`: tickets from `calls`, bytes over `http` (the
    agent's session, which it closes), streams spooled under `spool` (the agent's own directory)."""

    def __init__(self, calls: AgentCalls, lease_id: str, http: aiohttp.ClientSession, spool: Path) -> None:
        self.calls = calls
        self.lease_id = lease_id
        self.http = http
        self.spool = spool
        self.location = f"tickets for attempt {lease_id} from the pool server"

    # -- tickets ----------------------------------------------------------------------------------

    async def _ticket(self, call: str, key: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """The server's answer to `call` for `key`, its refusals as storage errors."""
        try:
            return await self.calls.call(self.lease_id, call, args)
        except PoolUnreachable as exc:
            raise TransferFailed(f"no ticket for {key!r}: {exc.message}") from None
        except ClientError as exc:
            if exc.code == ErrorCode.NOT_FOUND:
                raise ObjectNotFound(key) from None
            raise StorageError(f"the pool server gave no ticket for {key!r}: {exc.message}") from None

    async def _get_ticket(self, key: str) -> tuple[str, ObjectInfo]:
        check_key(key)
        value = await self._ticket("store_get", key, {"key": key})
        url, size, sha = value.get("url"), value.get("size"), value.get("sha256")
        if (
            not isinstance(url, str)
            or not url
            or not isinstance(size, int)
            or not isinstance(sha, str | None)
        ):
            raise StorageError(f"the pool server's ticket for {key!r} is not a url, a size and a sha256")
        return url, ObjectInfo(key, size, sha)

    # -- reading ----------------------------------------------------------------------------------

    async def head(self, key: str) -> ObjectInfo:
        return (await self._get_ticket(key))[1]

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        value = await self._ticket("store_list", prefix, {"prefix": prefix})
        objects = value.get("objects")
        try:
            assert isinstance(objects, list)
            found = [ObjectInfo(str(o["key"]), int(o["size"]), o.get("sha256")) for o in objects]
        except (AssertionError, KeyError, TypeError, ValueError):
            raise StorageError(f"the pool server's listing of {prefix!r} is not a list of objects") from None
        return sorted(found, key=lambda o: o.key)

    async def get_file(self, key: str, dest: Path) -> ObjectInfo:
        url, info = await self._get_ticket(key)
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:

                async def once() -> str:
                    f.seek(0)
                    f.truncate()
                    h = hashlib.sha256()
                    await self._fetch(url, key, info.size, lambda data: _write(f, h, data))
                    return h.hexdigest()

                got = await self._tries(f"GET {key}", once)
            _verified(info, got)
            os.replace(name, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)  # a failed or cancelled download leaves no partial file
        return ObjectInfo(key, info.size, got)

    async def get_bytes(self, key: str) -> bytes:
        url, info = await self._get_ticket(key)
        buf = bytearray()

        async def once() -> str:
            buf.clear()
            await self._fetch(url, key, info.size, buf.extend)
            return hashlib.sha256(buf).hexdigest()

        _verified(info, await self._tries(f"GET {key}", once))
        return bytes(buf)

    async def _fetch(self, url: str, key: str, size: int, take: Callable[[bytes], object]) -> None:
        """GET `url`, handing each chunk to `take`; exactly `size` bytes must come."""
        got = 0
        async with self.http.get(url) as response:
            if response.status == 404:
                raise ObjectNotFound(key)
            _check_status(response.status, f"GET {key}")
            async for data in response.content.iter_chunked(CHUNK):
                got += len(data)
                if got > size:
                    raise TransferFailed(f"GET {key}: more than the {size} bytes the ticket said")
                take(data)  # a chunk into the page cache or memory: no thread hop for it
        if got != size:
            raise _Retry(f"GET {key}: {got} of {size} bytes came")

    # -- writing ----------------------------------------------------------------------------------

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
        _plain(key, metadata, if_absent)
        sha, size = await asyncio.to_thread(_sha256_and_size, Path(path))
        if sha256 is not None and sha != sha256:
            raise ChecksumMismatch(key, sha256, sha)
        value = await self._ticket("store_put", key, {"key": key, "size": size, "sha256": sha})
        url = value.get("url")
        if not isinstance(url, str) or not url:
            raise StorageError(f"the pool server's ticket to write {key!r} has no url")

        async def once() -> str:
            h = hashlib.sha256()
            headers = {f"x-amz-meta-{SHA256_META}": sha, "Content-Length": str(size)}
            async with self.http.put(url, data=_read(Path(path), h), headers=headers) as response:
                _check_status(response.status, f"PUT {key}")
            return h.hexdigest()

        sent = await self._tries(f"PUT {key}", once)
        if sent != sha:  # changed after it was hashed: the object's bytes and its sha256 disagree
            raise ChecksumMismatch(key, sha, sent)
        return ObjectInfo(key, size, sha)

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
        _plain(key, metadata, if_absent)
        self.spool.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=self.spool, prefix="put-")
        try:
            with os.fdopen(fd, "wb") as f:
                async for data in chunks:
                    f.write(data)
            return await self.put_file(key, Path(name), sha256=sha256)
        finally:
            os.unlink(name)

    # -- not an attempt's to do -------------------------------------------------------------------

    async def delete(self, key: str) -> None:
        raise StorageError(f"an agent does not delete objects ({key!r}): the pool server keeps the store")

    async def adopt(self, staged: str, key: str, sha256: str) -> ObjectInfo:
        raise StorageError(f"an agent does not publish objects ({key!r}): the pool server keeps the store")

    async def presign_get(self, key: str, expires: int = 3600) -> str | None:
        return None  # its tickets are the server's to sign

    async def presign_put(self, key: str, expires: int = 3600, sha256: str | None = None) -> str | None:
        return None

    # -- retries ----------------------------------------------------------------------------------

    async def _tries(self, what: str, once: Callable[[], Awaitable[T]]) -> T:
        """`once()`, tried again after a network error or a 5xx answer, TRIES times in all."""
        delay = BACKOFF
        for attempt in range(1, TRIES + 1):
            try:
                return await once()
            except (aiohttp.ClientError, TimeoutError, ConnectionError, _Retry) as exc:
                if attempt == TRIES:
                    raise TransferFailed(f"{what}: {exc} (tried {TRIES} times)") from None
            await asyncio.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")


class _Retry(Exception):
    """A transfer that may succeed when tried again (a 5xx answer, a body cut short)."""


def _check_status(status: int, what: str) -> None:
    if status >= 500:
        raise _Retry(f"{what}: the store answered {status}")
    if status >= 300:
        raise StorageError(f"{what}: the store answered {status} (the ticket may have expired)")


def _plain(key: str, metadata: Mapping[str, str] | None, if_absent: bool) -> None:
    """A ticket carries the object's size and sha256, nothing else: no metadata, no condition."""
    if metadata or if_absent:
        raise StorageError(f"an agent writes {key!r} as it is: no metadata, no conditional write")


def _verified(info: ObjectInfo, got: str) -> None:
    if info.sha256 is not None and got != info.sha256:
        raise ChecksumMismatch(info.key, info.sha256, got)


def _write(f: Any, h: Any, data: bytes) -> None:
    h.update(data)
    f.write(data)


def _sha256_and_size(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while data := f.read(CHUNK):
            h.update(data)
            size += len(data)
    return h.hexdigest(), size


async def _read(path: Path, h: Any) -> AsyncIterator[bytes]:
    """The file's bytes for a PUT body, hashed into `h` as they go."""
    with open(path, "rb") as f:  # noqa: ASYNC230 - read in a thread below; the open is one syscall
        while data := await asyncio.to_thread(f.read, CHUNK):
            h.update(data)
            yield data
