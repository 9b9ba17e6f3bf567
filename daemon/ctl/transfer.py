"""poolctl's side of data transfers: content-address, ask the server, move the bytes directly.

The server never carries dataset or artifact bytes (see daemon/server/data_desk.py for why). For an upload
poolctl hashes the source (a file, a directory packed as a deterministic tar, or a project's
pack), asks `PrepareUpload`, and then either skips (already stored), PUTs the bytes to the
presigned URL with the signed `x-amz-meta-sha256` header, or, on a single-machine pool, writes
them into the local store's directory itself; then `FinishUpload` has the server check and record
the object. A download asks `PrepareDownload` and GETs the presigned URL (or reads the local
store), verifying the sha256 before the file appears at its destination.

Progress bars (bytes, rate, ETA) are drawn on stderr only when it is a terminal. rich (for the
bars) and aiohttp (for presigned URLs) are imported only where they are used: a resubmit that
sends nothing, to a pool on this machine, needs neither, and importing them is much of its time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.client.pool_client import ClientError, PoolClient
from daemon.errors import GpupoolError
from protocol import (
    DownloadTicket,
    ErrorCode,
    FinishUpload,
    ObjectRef,
    PrepareDownload,
    PrepareUpload,
    ResolveName,
    UploadTicket,
)
from storage.base import SHA256_META
from storage.content import (
    CHUNK,
    iterate_in_thread,
    pack_entries,
    pack_tree,
    sha256_file,
    stream_sha256,
)
from storage.local import LocalStore

Advance = Callable[[int], None]


class TransferError(GpupoolError):
    """An upload or download through a presigned URL failed."""


@dataclass(frozen=True, slots=True)
class Source:
    """Bytes to upload, content-addressed: a file, or a deterministic tar of the tree at `path` (or
    of `entries`: a project's pack)."""

    kind: str  # "file" or "dir"
    path: Path
    sha256: str
    size: int
    # for a project's pack: these files, each (its name in the tar, where it is read)
    entries: tuple[tuple[str, str], ...] | None = None

    def chunks(self) -> AsyncIterator[bytes]:
        if self.kind == "file":
            return _read_file(self.path)
        if self.entries is not None:
            return iterate_in_thread(pack_entries(self.entries))
        return iterate_in_thread(pack_tree(self.path))


async def _read_file(path: Path) -> AsyncIterator[bytes]:
    f = await asyncio.to_thread(open, path, "rb")
    try:
        while chunk := await asyncio.to_thread(f.read, CHUNK):
            yield chunk
    finally:
        f.close()


def _describe(path: Path) -> Source:
    if path.is_dir():
        sha, size = stream_sha256(pack_tree(path))
        return Source("dir", path, sha, size)
    if not path.is_file():
        raise TransferError(f"{path}: no such file or directory")
    return Source("file", path, sha256_file(path), path.stat().st_size)


async def describe(path: Path) -> Source:
    """Hash a file or a directory (as its tar) without storing anything."""
    return await asyncio.to_thread(_describe, path)


# -- progress ----------------------------------------------------------------------------------


@contextlib.contextmanager
def progress(description: str, total: int) -> Iterator[Advance]:
    """An `advance(nbytes)` callable drawing a bar on a terminal, doing nothing otherwise."""
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


async def _counted(chunks: AsyncIterator[bytes], advance: Advance) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        advance(len(chunk))
        yield chunk


# -- upload and download -----------------------------------------------------------------------


async def upload(client: PoolClient, source: Source, name: str | None, label: str) -> tuple[ObjectRef, bool]:
    """Store `source` (unless the pool has it already) and record it. Returns the object and
    whether bytes were sent."""
    ticket = await client.call(PrepareUpload(source.sha256, source.size), UploadTicket)
    sent = not ticket.exists
    if sent:
        with progress(f"put {label}", source.size) as advance:
            chunks = _counted(source.chunks(), advance)
            if ticket.url is not None:
                await _put_url(ticket.url, source, chunks)
            elif ticket.local_store is not None:
                async with LocalStore(Path(ticket.local_store)) as store:
                    await store.put_stream(ticket.key, chunks, sha256=source.sha256)
            else:
                raise ClientError("the server gave no place to upload to")
    ref = await client.call(FinishUpload(source.sha256, source.kind, name), ObjectRef)
    return ref, sent


async def _put_url(url: str, source: Source, chunks: AsyncIterator[bytes]) -> None:
    # An explicit Content-Length: S3 refuses chunked transfer encoding on a presigned PUT.
    headers = {f"x-amz-meta-{SHA256_META}": source.sha256, "Content-Length": str(source.size)}
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=300)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.put(url, data=chunks, headers=headers) as response,
    ):
        if response.status >= 300:
            text = (await response.text())[:300]
            raise TransferError(f"the object store refused the upload: HTTP {response.status}: {text}")


async def download(client: PoolClient, key: str, dest: Path, label: str, sha256: str | None = None) -> int:
    """Fetch `key` to `dest` (verified, atomic). `sha256`: what the object must be, as recorded
    by whoever made it (a job's result); the store's own checksum must then be the same. Returns
    its size."""
    ticket = await client.call(PrepareDownload(key), DownloadTicket)
    if sha256 is not None and ticket.sha256 != sha256:
        raise TransferError(
            f"{label}: the store holds {key} with sha256 {ticket.sha256}, but the job recorded "
            f"{sha256}: not fetched (the object was replaced, or the record forged)"
        )
    with progress(f"get {label}", ticket.size) as advance:
        if ticket.local_store is not None:
            async with LocalStore(Path(ticket.local_store)) as store:
                await store.get_file(key, dest)
            advance(ticket.size)
        elif ticket.url is not None:
            await _get_url(ticket, dest, advance)
        else:
            raise ClientError("the server gave no place to download from")
    return ticket.size


async def _get_url(ticket: DownloadTicket, dest: Path, advance: Advance) -> None:
    assert ticket.url is not None
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    tmp = Path(name)
    h = hashlib.sha256()
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=300)
    try:
        with os.fdopen(fd, "wb") as f:
            async with aiohttp.ClientSession(timeout=timeout) as session, session.get(ticket.url) as response:
                if response.status != 200:
                    raise TransferError(f"the object store refused the download: HTTP {response.status}")
                async for chunk in response.content.iter_chunked(CHUNK):
                    h.update(chunk)
                    await asyncio.to_thread(f.write, chunk)
                    advance(len(chunk))
        if ticket.sha256 is not None and h.hexdigest() != ticket.sha256:
            raise TransferError(
                f"{ticket.key} arrived with sha256 {h.hexdigest()}, expected {ticket.sha256}: not saved"
            )
        os.replace(tmp, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


# -- what poolctl's commands do ----------------------------------------------------------------


def split_input(text: str) -> tuple[str, str | None, bool]:
    """`NAME_OR_PATH[:DEST]` as (name or path, DEST, whether it is a local path). An existing path
    is taken whole; otherwise the last `:` parts DEST off. A path that is not there (what has a
    '/' or starts with '.' or '~': no dataset name does) is a TransferError."""
    if os.path.exists(text):
        return text, None, True
    head, sep, tail = text.rpartition(":")
    what, dest = (head, tail or None) if sep and head else (text, None)
    local = os.path.exists(what)
    if not local and ("/" in what or what.startswith((".", "~"))):  # no dataset name looks so
        raise TransferError(f"--input {what}: no such file or directory")
    return what, dest, local


async def put(client: PoolClient, path: Path, name: str | None) -> tuple[ObjectRef, bool]:
    """`poolctl put`: upload a file or a directory (as its tar) content-addressed."""
    source = await describe(path)
    return await upload(client, source, name, path.name or str(path))


async def resolve_input(client: PoolClient, text: str) -> dict[str, str]:
    """An `--input` as the job spec's `inputs` entry; a local path is uploaded first."""
    what, dest, local = await asyncio.to_thread(split_input, text)
    if local:
        ref, _ = await put(client, Path(what), None)
        default = Path(what).name or what
    else:
        ref = await client.call(ResolveName(what), ObjectRef)
        default = what
    return {"sha256": ref.sha256, "dest": dest or default, "kind": ref.kind}


def _inside(dest: Path, name: object) -> Path:
    """`dest/name`, for a name the server sent: a relative path of plain segments, or TransferError.
    The server is not trusted with where poolctl writes (a forged record could name ~/.bashrc)."""
    if (
        not isinstance(name, str)
        or not name
        or name.startswith("/")
        or "\x00" in name
        or "\\" in name
        or any(part in {"", ".", ".."} for part in name.split("/"))
    ):
        raise TransferError(
            f"the job's record names an artifact {name!r} outside DEST: refused, nothing fetched"
        )
    return dest / name


def recorded_sha256(item: dict[str, Any]) -> str:
    """The sha256 a job's record holds for an object it uploaded; a record without one is refused."""
    sha256 = item.get("sha256")
    if not isinstance(sha256, str) or len(sha256) != 64:
        raise TransferError(
            f"the job's record holds no sha256 for {item.get('key')!r}: refused, nothing fetched"
        )
    return sha256


def make_dest(dest: Path) -> None:
    """`get`'s DEST as a directory, made if missing; a DEST that is a file or cannot be made is the
    command line's mistake (INVALID_ARGUMENT), said before anything is fetched."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = "is not a directory" if dest.exists() else f"cannot be created ({exc.strerror})"
        raise TransferError(
            f"DEST {dest} {why}: give a directory to write the job's files into (made if missing)",
            ErrorCode.INVALID_ARGUMENT,
        ) from None


async def get_artifacts(client: PoolClient, job: dict[str, Any], dest: Path) -> list[tuple[str, int]]:
    """`poolctl get`: the committed attempt's artifacts under `dest`, and its log as
    `dest/<job>.log`. Every path is checked before anything is fetched (DEST made, if missing,
    only then), and every object against the sha256 the job's record holds. Returns (path
    written, size) pairs."""
    result = job.get("result") or {}
    wanted = [
        (a["key"], _inside(dest, a["name"]), a["name"], recorded_sha256(a))
        for a in result.get("artifacts", [])
    ]
    if log := result.get("log"):
        wanted.append((log["key"], _inside(dest, f"{job['id']}.log"), "log", recorded_sha256(log)))
    await asyncio.to_thread(make_dest, dest)
    written = []
    for key, path, label, sha256 in wanted:
        size = await download(client, key, path, label, sha256)
        written.append((str(path), size))
    return written
