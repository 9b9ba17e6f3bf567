"""What an attempt run by an agent may read and write in the pool's object store (docs/PROTOCOL.md
§3.4: `store_get`, `store_list`, `store_put`). The agent holds no store credential: the server signs
one URL at a time, each for one key the attempt's own lease entitles it to.

- Read (`store_get`): the attempt's inputs, which are the content keys of its job's snapshot,
  `--input` objects and project packs (`data_desk.data_of`; `sha256/..`, as the worker's cache
  fetches them: storage/cache.py), and its
  job's checkpoint saves (`checkpoints/JOB/`), which a later attempt restores from. Nothing else:
  knowing another object's sha256 or another job's id is no key to its bytes.
- List (`store_list`): its job's checkpoint saves only.
- Write (`store_put`): under its own attempt's names only, its artifacts
  (`artifacts/JOB/LEASE/`, object_store.artifact_prefix) and its saves (`checkpoints/JOB/LEASE.`,
  worker/checkpoints.py), LEASE its lease id as object_store.attempt_segment writes it, which no
  other execution shares: an agent cannot replace what another attempt, or another job, wrote.
  The URL is signed with the object's sha256 (the agent sends it as `x-amz-meta-sha256`).

A store that cannot presign (a single machine's local directory) serves no agent: UNAVAILABLE.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from daemon.errors import GpupoolError
from daemon.job import Lease
from daemon.object_store import artifact_prefix, attempt_segment, checkpoint_prefix
from daemon.server.data_desk import data_of
from daemon.spec_checks import SHA256
from protocol import ErrorCode
from storage.base import ObjectNotFound, ObjectStore, check_key
from storage.content import content_key

URL_SECONDS = 3600  # how long a signed URL holds: a large input or artifact may take a while
MAX_PUT = 5 * 1024**3  # S3's largest single PUT


def inputs_of(lease: Lease) -> set[str]:
    """The content keys of what the attempt's job reads: its inputs, snapshot, project packs."""
    return {content_key(sha) for sha in data_of(lease.spec)}


def may_read(lease: Lease, key: str) -> bool:
    return key in inputs_of(lease) or key.startswith(checkpoint_prefix(lease.job_id))


def may_write(lease: Lease, key: str) -> bool:
    saves = checkpoint_prefix(lease.job_id) + attempt_segment(lease.id) + "."
    return key.startswith((artifact_prefix(lease.job_id, lease.id), saves))


def _refused(message: str) -> GpupoolError:
    return GpupoolError(message, ErrorCode.PERMISSION_DENIED)


class AgentStore:
    """The store calls of agents' attempts, on the server's `store`."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    async def call(self, lease: Lease, call: str, args: Mapping[str, Any]) -> dict[str, Any]:
        match call:
            case "store_get":
                return await self._get(lease, _key(args.get("key")))
            case "store_list":
                prefix, own = args.get("prefix"), checkpoint_prefix(lease.job_id)
                if not isinstance(prefix, str) or not prefix.startswith(own):
                    raise _refused(f"an attempt lists its own job's saves only: {own}")
                _key(prefix.rstrip("/"))  # no `..` in it
                objects = await self.store.list(prefix)
                return {"objects": [{"key": o.key, "size": o.size, "sha256": o.sha256} for o in objects]}
            case _:  # store_put
                return await self._put(lease, _key(args.get("key")), args.get("size"), args.get("sha256"))

    async def _get(self, lease: Lease, key: str) -> dict[str, Any]:
        if not may_read(lease, key):
            raise _refused(
                f"{key!r} is not this attempt's to read: only its job's inputs, snapshot and project, "
                f"and its job's saves ({checkpoint_prefix(lease.job_id)})"
            )
        try:
            info = await self.store.head(key)
        except ObjectNotFound:
            raise GpupoolError(f"{key!r} is not in the pool's object store", ErrorCode.NOT_FOUND) from None
        url = await self.store.presign_get(key, URL_SECONDS)
        return {"url": _signed(url), "size": info.size, "sha256": info.sha256}

    async def _put(self, lease: Lease, key: str, size: Any, sha256: Any) -> dict[str, Any]:
        if not may_write(lease, key):
            raise _refused(
                f"{key!r} is not this attempt's to write: only under its own artifacts "
                f"({artifact_prefix(lease.job_id, lease.id)}) and saves "
                f"({checkpoint_prefix(lease.job_id)}{attempt_segment(lease.id)}.)"
            )
        if not isinstance(sha256, str) or not SHA256.fullmatch(sha256):
            raise GpupoolError("sha256 must be 64 lowercase hex digits", ErrorCode.INVALID_ARGUMENT)
        if not isinstance(size, int) or not 0 <= size <= MAX_PUT:
            raise GpupoolError(
                f"size must be 0 to {MAX_PUT} bytes (S3's largest single PUT)", ErrorCode.INVALID_ARGUMENT
            )
        url = await self.store.presign_put(key, URL_SECONDS, sha256=sha256)
        return {"url": _signed(url)}


def _key(key: Any) -> str:
    """A key as both stores read it (storage.base.check_key: no `..`, no leading `/`)."""
    if not isinstance(key, str):
        raise GpupoolError("key must be a string", ErrorCode.INVALID_ARGUMENT)
    return check_key(key)  # InvalidKey: INVALID_ARGUMENT (handlers.py)


def _signed(url: str | None) -> str:
    if url is None:
        raise GpupoolError(
            "this pool's object store is a local directory, which signs no URLs: agent workers need "
            "a pool on S3 (worker_mode = multinode)",
            ErrorCode.UNAVAILABLE,
        )
    return url
