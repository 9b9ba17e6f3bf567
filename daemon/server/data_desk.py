"""The server's side of data transfers: it authorises and records, it never carries the bytes.

Why this shape. A dataset or an artifact can be gigabytes; the server is one asyncio process that
also serves every client's queue requests, so funnelling bytes through its event loop would make a
large upload everyone's latency problem. Instead the server answers small requests:

- `PrepareUpload(sha256, size)`: if the caller has uploaded the object before (an owner record,
  `owners/SHA256/u=USER`), the answer says so and nothing is sent. Otherwise, on S3, a presigned
  PUT URL valid for `PUT_URL_SECONDS` to the caller's own staging key (`uploads/u=USER/SHA256`),
  never to the content key, signed with the object's `x-amz-meta-sha256` header and its size.
  A single presigned PUT carries at most `MAX_PRESIGNED_PUT` bytes (S3's limit for one PUT, 5
  GiB); larger objects are refused with a sentence saying so. Someone else having stored the same
  bytes changes nothing: knowing a sha256 is not having the data, so the caller sends it too. On
  the local store (single machine: client and server share it) the answer is the store's
  directory, and the client writes through `storage.local.LocalStore` itself, with the same
  atomic-publish rules.
- `CheckObjects(sha256s)`: which of many objects the caller has stored already (stored, and an
  owner record of the caller's), in one request: a project's packs are asked about at once, and
  those held need neither PrepareUpload nor FinishUpload again.
- `FinishUpload(sha256, kind, name)`: the server reads the staged object back, hashes it, and
  only if it is what the caller claimed publishes it under its content key (a copy on the store's
  side, never over an object already there; `ObjectStore.adopt`), records the caller as an owner,
  and records `name` -> {sha256, size, kind} (a small JSON object under `names/`).
- `ResolveName(name)`: that record.
- `PrepareDownload(key)`: a presigned GET (or the local store's directory), for keys under
  `sha256/` and `artifacts/` only, with the size and sha256 the downloader verifies against.

`check_inputs` refuses a job whose inputs, snapshot or project packs its user has not uploaded: a
sha256 seen in a log or a job record must not be a way to read the bytes through a job. Objects
stored before owners were recorded (no owner at all) are still allowed.

Workers do not ask: they hold the store's credentials (configured by the admin) and read and write
it directly (`daemon/worker/job_data.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import orjson

from daemon.errors import GpupoolError
from daemon.job import JobSpec
from daemon.object_store import (
    DATASET_NAME,
    UPLOADS_PREFIX,
    legacy_name_key,
    name_key,
    owner_key,
    owners_prefix,
    upload_key,
)
from daemon.spec_checks import INPUT_KINDS, SHA256
from protocol import DownloadTicket, ErrorCode, ObjectRef, ObjectsHeld, UploadTicket
from storage.base import ChecksumMismatch, ObjectInfo, ObjectNotFound, ObjectStore, StorageError
from storage.content import content_key
from storage.local import LocalStore

log = logging.getLogger(__name__)

URL_SECONDS = 3600  # a presigned GET: a large artifact may take a while to start on a slow link
# A presigned PUT is asked for right before the upload starts (poolctl does both at once), and S3
# checks the expiry when the request arrives, so a long upload still finishes: short, to leave a
# URL that leaked little time to be used.
PUT_URL_SECONDS = 600
MAX_PRESIGNED_PUT = 5 * 1024**3  # S3's largest single PUT
# A staged upload whose FinishUpload has not come this long after its PUT completed was abandoned
# (poolctl finishes at once): removed by the server's prune, every PRUNE_SECONDS.
STALE_UPLOAD_SECONDS = 3600
PRUNE_SECONDS = 900
READABLE_PREFIXES = ("sha256/", "artifacts/")
MAX_CHECKED = 1024  # objects one CheckObjects may ask about (a project has at most 512 packs)
CHECKS_AT_ONCE = 16  # store requests one CheckObjects has in flight


class DataNotFound(GpupoolError):
    code = ErrorCode.NOT_FOUND


class BadDataRequest(GpupoolError):
    code = ErrorCode.INVALID_ARGUMENT


class DataDesk:
    """Answers the data requests of clients for one store."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    def _local_root(self) -> str | None:
        return str(self.store.root) if isinstance(self.store, LocalStore) else None

    async def prepare_upload(self, sha256: str, size: int, user: str) -> UploadTicket:
        key = content_key(_check_sha(sha256))
        if size < 0:
            raise BadDataRequest("size must not be negative")
        local = self._local_root()
        if local is not None:
            return UploadTicket(key, await self.store.exists(key), None, local)
        if await self.store.exists(owner_key(sha256, user)) and await self.store.exists(key):
            return UploadTicket(key, True, None, None)
        if size > MAX_PRESIGNED_PUT:
            raise BadDataRequest(
                f"{size} bytes is over the {MAX_PRESIGNED_PUT} bytes one presigned upload may carry; "
                "split the dataset into several inputs",
            )
        staged = upload_key(user, sha256)
        url = await self.store.presign_put(staged, PUT_URL_SECONDS, sha256=sha256)
        return UploadTicket(staged, False, url, None)

    async def check_objects(self, sha256s: list[str], user: str) -> ObjectsHeld:
        """Those of `sha256s` stored and recorded as `user`'s upload, in the order asked."""
        if len(sha256s) > MAX_CHECKED:
            raise BadDataRequest(f"{len(sha256s)} objects asked about at once; at most {MAX_CHECKED}")
        for sha in sha256s:
            _check_sha(sha)
        limit = asyncio.Semaphore(CHECKS_AT_ONCE)

        async def held(sha: str) -> bool:
            async with limit:
                return await self.store.exists(owner_key(sha, user)) and await self.store.exists(
                    content_key(sha)
                )

        found = await asyncio.gather(*(held(sha) for sha in sha256s))
        return ObjectsHeld([sha for sha, ok in zip(sha256s, found, strict=True) if ok])

    async def finish_upload(self, sha256: str, kind: str, name: str | None, user: str) -> ObjectRef:
        key = content_key(_check_sha(sha256))
        if kind not in INPUT_KINDS:
            raise BadDataRequest(f"kind {kind!r} must be one of {', '.join(INPUT_KINDS)}")
        if name is not None:
            _check_name(name)
        info = await (
            self._local_upload(key, sha256) if self._local_root() else self._adopt(key, sha256, user)
        )
        await self.store.put_bytes(owner_key(sha256, user), b"")
        if name is not None:
            record = {"sha256": sha256, "size": info.size, "kind": kind}
            await self.store.put_bytes(name_key(user, name), orjson.dumps(record))
            log.info("dataset %s of %s -> %s (%d bytes, %s)", name, user, sha256, info.size, kind)
        return ObjectRef(name, sha256, info.size, kind)

    async def _local_upload(self, key: str, sha256: str) -> ObjectInfo:
        """The client wrote the content key itself, through the local store's atomic publish."""
        try:
            info = await self.store.head(key)
        except ObjectNotFound:
            raise DataNotFound(f"object {sha256} was not uploaded (or not completely)") from None
        if info.sha256 != sha256:
            await self.store.delete(key)
            raise BadDataRequest(f"the stored object {key} does not carry sha256 {sha256}; removed it")
        return info

    async def _adopt(self, key: str, sha256: str, user: str) -> ObjectInfo:
        """What `user` staged, hashed and published: nothing else reaches a content key. (An owner
        told the object is stored sent nothing: theirs is there.)"""
        if await self.store.exists(owner_key(sha256, user)):
            with contextlib.suppress(ObjectNotFound):
                return await self.store.head(key)
        try:
            return await self.store.adopt(upload_key(user, sha256), key, sha256)
        except ObjectNotFound:
            raise DataNotFound(f"object {sha256} was not uploaded (or not completely)") from None
        except ChecksumMismatch as exc:
            raise BadDataRequest(
                f"the bytes uploaded hash to {exc.got}, not to the sha256 {sha256} they were sent "
                "as; they were removed (upload the file again)"
            ) from None

    async def check_inputs(self, spec: JobSpec, user: str) -> None:
        """PERMISSION_DENIED for the first input, snapshot or project pack of `spec` that `user`
        has not uploaded (objects from before owners were recorded, with none at all, pass)."""
        for sha in dict.fromkeys(data_of(spec)):
            if await self.store.exists(owner_key(sha, user)):
                continue
            if await self.store.list(owners_prefix(sha)):
                raise GpupoolError(
                    f"input {sha[:12]} is data you have not uploaded: a job may read only its "
                    "own user's data (poolctl put it, or name one of your datasets)",
                    ErrorCode.PERMISSION_DENIED,
                )

    async def resolve(self, name: str, user: str) -> ObjectRef:
        """`user`'s dataset `name`; one named before names were per user is found too."""
        _check_name(name)
        for key in (name_key(user, name), legacy_name_key(name)):
            try:
                record = orjson.loads(await self.store.get_bytes(key))
            except ObjectNotFound:
                continue
            return ObjectRef(name, record["sha256"], record["size"], record["kind"])
        raise DataNotFound(f"you have no dataset named {name!r} in this pool (poolctl put PATH --name NAME)")

    async def prepare_download(self, key: str) -> DownloadTicket:
        if not key.startswith(READABLE_PREFIXES):
            raise BadDataRequest(f"{key!r} is not a dataset or an artifact key")
        try:
            info: ObjectInfo = await self.store.head(key)
        except ObjectNotFound:
            raise DataNotFound(f"no object {key!r} in the store") from None
        local = self._local_root()
        url = None if local is not None else await self.store.presign_get(key, URL_SECONDS)
        return DownloadTicket(key, info.size, info.sha256, url, local)


def data_of(spec: JobSpec) -> tuple[str, ...]:
    """The objects a job reads from the store: its inputs, its snapshot, its project's packs. The
    spec alone says which, so whatever authorises a worker's reads can judge them from it."""
    return (
        tuple(i["sha256"] for i in spec.inputs)
        + ((spec.snapshot["sha256"],) if spec.snapshot else ())
        + (tuple(spec.project["packs"]) if spec.project else ())
    )


def _check_sha(sha256: str) -> str:
    if not SHA256.fullmatch(sha256):
        raise BadDataRequest(f"sha256 {sha256!r} is not 64 lowercase hex digits")
    return sha256


def _check_name(name: str) -> str:
    if not DATASET_NAME.fullmatch(name):
        raise BadDataRequest(f"dataset name {name!r}: 1-128 of A-Z a-z 0-9 . _ - (not starting with .)")
    return name


async def prune_staged(store: ObjectStore, now: float) -> int:
    """Remove the staged uploads (`uploads/`) left unfinished for STALE_UPLOAD_SECONDS: bytes a
    client sent and never published, which nothing else would ever remove. How many went."""
    stale = [
        o.key
        for o in await store.list(UPLOADS_PREFIX)
        if o.modified is not None and o.modified < now - STALE_UPLOAD_SECONDS
    ]
    for key in stale:
        await store.delete(key)
    return len(stale)


async def prune_staged_forever(store: ObjectStore) -> None:
    """`prune_staged` every PRUNE_SECONDS until cancelled; a store that fails is tried next time."""
    while True:
        try:
            if removed := await prune_staged(store, time.time()):
                log.info("removed %d staged uploads never finished", removed)
        except StorageError as exc:
            log.warning("could not prune staged uploads (%s); trying again later", exc)
        except Exception:  # a pass that failed otherwise must not end the prune for good
            log.exception("pruning staged uploads failed; trying again later")
        await asyncio.sleep(PRUNE_SECONDS)
