"""The pool's object store, built from the configuration, and the few key names the daemon uses.

Single machine (`worker_mode = singlenode`): a `LocalStore` under the data directory, shared by the
server, its local slots and `poolctl` on the same machine. Multi-node: an `S3Store` on
`main_server_minio_*`. The server only opens it (no network: it presigns URLs and heads objects on
request); both it and a worker wait for the bucket at start (`main_server_minio_bucket_ping_timeout`)
and refuse to run without it, naming the endpoint and bucket and how to create it (`poold --make-bucket`).
"""

from __future__ import annotations

import logging
import re
from urllib.parse import quote

from daemon.config import Config
from daemon.errors import GpupoolError
from storage.base import ObjectStore, StorageError
from storage.local import LocalStore
from storage.s3 import S3Store

log = logging.getLogger(__name__)

# A dataset name (`poolctl put --name`): one path segment of safe characters.
DATASET_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def make_store(config: Config) -> ObjectStore:
    """The store `config` names (not yet opened)."""
    if config.embedded:
        return LocalStore(config.data_path() / "store")
    return S3Store(
        config.main_server_minio_address,
        config.main_server_minio_bucket,
        config.main_server_minio_access_key_id,
        config.main_server_minio_secret_access_key,
    )


# How an operator makes the bucket a server or worker found missing: with the pool's own tool and
# the daemon's own configuration, so the sentence is true wherever poold runs.
MAKE_BUCKET = "create it with `poold --make-bucket` and this configuration (docs/OPERATIONS.md §3)"


async def open_checked(store: ObjectStore, config: Config, role: str) -> None:
    """Open `store` for the server or a worker (`role`); on S3, wait for the bucket for
    `main_server_minio_bucket_ping_timeout`. A daemon that started without it would fail every
    upload and every job later, far from the cause, so it refuses now: GpupoolError, one sentence
    naming the endpoint, the bucket, why, and how to create it."""
    try:
        await store.open()
        if isinstance(store, S3Store):
            await store.wait_for_bucket(config.main_server_minio_bucket_ping_timeout)
    except StorageError as exc:
        await store.close()
        why = f"the {role} cannot start without its object store: {exc.message}; {MAKE_BUCKET}"
        raise GpupoolError(why) from None
    log.info("object store: %s", store.location)


async def open_worker_store(config: Config) -> ObjectStore:
    """Open the store for a worker (open_checked)."""
    store = make_store(config)
    await open_checked(store, config, "worker")
    return store


async def make_bucket(config: Config) -> str:
    """Create the bucket `config` names, if it does not exist (`poold --make-bucket`), and check it
    answers; returns a sentence saying where it is. Raises GpupoolError for a single-machine pool
    (its store is a directory) or a store that refuses (its own sentence)."""
    store = make_store(config)
    if not isinstance(store, S3Store):
        raise GpupoolError(
            "a single-machine pool (worker_mode = singlenode) keeps its data under data_dir: "
            "there is no bucket to make"
        )
    try:
        async with store:
            await store.ensure_bucket()
            await store.wait_for_bucket(config.main_server_minio_bucket_ping_timeout)
    except StorageError as exc:
        raise GpupoolError(f"cannot make the bucket: {exc.message}") from None
    return f"bucket {store.bucket!r} at {store.endpoint} is ready"


def name_key(user: str, name: str) -> str:
    """Where the record of `user`'s dataset `name` lives (a small JSON object: sha256, size, kind).
    Names are each user's own: alice's `imagenet` is not bob's. The user is quoted, so no name
    can reach outside `names/` or into another user's names."""
    return f"names/u={quote(user, safe='')}/{name}.json"


UPLOADS_PREFIX = "uploads/"


def upload_key(user: str, sha256: str) -> str:
    """Where `user` uploads the object `sha256` through a presigned PUT: their own staging key,
    never the content key, which only the server writes once it has hashed the bytes
    (server/data_desk.py). A content key therefore holds what its name says, and no user can
    take one before its owner uploads it."""
    return f"{UPLOADS_PREFIX}u={quote(user, safe='')}/{sha256}"


def owner_key(sha256: str, user: str) -> str:
    """An empty object: `user` has uploaded the bytes of `sha256` (proved by sending them), so
    their jobs may take it as an input. Listing `owners/SHA256/` names every such user."""
    return f"owners/{sha256}/u={quote(user, safe='')}"


def owners_prefix(sha256: str) -> str:
    return f"owners/{sha256}/"


def legacy_name_key(name: str) -> str:
    """Where a dataset name lived when names were pool-wide: still read (never written), so datasets
    named before this change still resolve, and no one can replace them any more."""
    return f"names/{name}.json"


def attempt_segment(lease_id: str) -> str:
    """One attempt's name in the keys of what it writes (its checkpoint saves, its artifacts): its
    lease id, which never repeats. Its number can: after Redis lost a claim, the job is claimed
    again with the same number while the forgotten execution may still run and write
    (docs/GUARANTEES.md, promise 2). Quoted into one segment: a lease id is WORKER/REQUEST.INDEX."""
    return quote(lease_id, safe="")


def checkpoint_prefix(job_id: str) -> str:
    """Every save of a job's checkpoint directory is under this prefix (worker/checkpoints.py)."""
    return f"checkpoints/{job_id}/"


def artifact_prefix(job_id: str, lease_id: str) -> str:
    """Every object an attempt uploads is under this prefix, named by its lease: no other
    execution, a zombie or one whose claim Redis forgot, can replace what the committed
    attempt's outcome points to. (Jobs that ended before attempts were named so have their
    artifacts under `artifacts/JOB/ATTEMPT-NUMBER/`; their records hold those keys.)"""
    return f"artifacts/{job_id}/{attempt_segment(lease_id)}/"


def artifact_job(key: str) -> str | None:
    """The job whose artifact `key` is (`artifacts/JOB/ATTEMPT/NAME`, ATTEMPT its lease id as
    `attempt_segment` writes it, or an attempt number in keys written before), or None for other keys."""
    parts = key.split("/")
    return parts[1] if len(parts) >= 4 and parts[0] == "artifacts" else None
