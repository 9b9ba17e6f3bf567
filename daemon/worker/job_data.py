"""A job's data on the worker: its project, snapshot and inputs before it starts, its artifacts after
it ends.

Before: the project's packs (deterministic tars of its files, daemon/ctl/project_packs.py) are
unpacked in order as the job's directory, or the code snapshot (one such tar, sent by a poolctl of
before projects), then each input is placed at its `dest` in that directory: a file as a hard link
to the worker's cache entry (read-only; a copy across filesystems) where the job runs as a slot uid
of its own, which cannot change an inode it does not own; as a copy of its own (a reflink where the
file system offers one) where it runs as the worker's uid, which owns the cache's inodes and could
`chmod u+w` a shared one and change the bytes for every later job (docs/SECURITY.md); a directory
unpacked from its tar. Everything comes through `storage.cache.ObjectCache`, so an object already
on this worker is not downloaded again, and two jobs wanting one object at once share one download.

After: every regular file under the job's `$GPUPOOL_OUTPUT`, and the attempt's full log, are
uploaded under `artifacts/<job>/<lease>/` (`daemon.object_store.artifact_prefix`: the attempt's
lease id, which never repeats) and described in the outcome's `result`, which only the fenced
`complete` can record; `poolctl get` and the dashboard find them by the keys there. A zombie
attempt, or an execution whose claim Redis forgot (it may have the committed attempt's number),
therefore uploads under a lease of its own, and its outcome (with its keys) is refused: the
committed attempt's artifacts are never replaced.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from daemon.errors import GpupoolError
from daemon.job import JobSpec, Lease
from daemon.object_store import artifact_prefix
from daemon.worker.pool_link import UNREACHABLE, PoolLink
from storage.base import InvalidKey, ObjectStore, StorageError
from storage.cache import ObjectCache
from storage.content import unpack_tar

log = logging.getLogger(__name__)

LOG_PAGE = 1000


class DataError(GpupoolError):
    """The job's data could not be put in place; the attempt fails with this sentence."""


async def prepare(
    cache: ObjectCache | None,
    spec: JobSpec,
    workdir: Path,
    note: Callable[[str], None],
    *,
    as_cache_owner: bool,
) -> None:
    """Unpack the project or the snapshot into `workdir` (empty), then place the inputs in it.
    `as_cache_owner`: the job runs as the uid that owns the cache (a worker with no slot uids), so
    each file input is a copy of its own (ObjectCache.place)."""
    if spec.project is None and spec.snapshot is None and not spec.inputs:
        return
    if cache is None:
        raise DataError(
            "this worker has no object store, so it cannot fetch the job's project, snapshot or inputs"
        )
    try:
        if spec.project is not None:
            await _place_project(cache, spec.project, workdir)
            note(project_line(spec.project))
        if spec.snapshot is not None:
            sha = spec.snapshot["sha256"]
            async with cache.use(sha) as tar:
                await asyncio.to_thread(unpack_tar, tar, workdir)
            dirty = " with uncommitted changes" if spec.snapshot.get("dirty") else ""
            note(f"snapshot {sha[:12]} of commit {spec.snapshot.get('commit', '')[:12]}{dirty}")
        for item in spec.inputs:
            dest = workdir / item["dest"]
            if await asyncio.to_thread(os.path.lexists, dest):
                raise DataError(f"input {item['dest']!r} would replace a file already in the job's directory")
            if item["kind"] == "file":
                await cache.place(item["sha256"], dest, private=as_cache_owner)
            else:
                async with cache.use(item["sha256"]) as tar:
                    await asyncio.to_thread(unpack_tar, tar, dest)
            note(f"input {item['sha256'][:12]} at {item['dest']}")
    except StorageError as exc:
        raise DataError(f"cannot fetch the job's data: {exc.message}") from None


async def _place_project(cache: ObjectCache, project: Mapping[str, Any], workdir: Path) -> None:
    """Each pack unpacked into `workdir` (each verified by its sha256 as the cache fetches it),
    then the directory the job starts in made, if no file of the project is in it."""
    for sha in project["packs"]:
        async with cache.use(sha) as tar:
            await asyncio.to_thread(unpack_tar, tar, workdir)
    if project["dir"]:
        start = workdir / project["dir"]
        try:
            await asyncio.to_thread(start.mkdir, parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise DataError(
                f"the project's {project['dir']!r} is not a directory: the job cannot start in it"
            ) from None


def project_line(project: Mapping[str, Any]) -> str:
    """What the job's log says of its project: its id, its commit, its files."""
    commit = f"of commit {project['commit'][:12]}" if project["commit"] else "outside git"
    dirty = " with uncommitted changes" if project["commit"] and project["dirty"] else ""
    return (
        f"project {project['id'][:12]} {commit}{dirty}: {project['files']} files, "
        f"{project['size']} bytes in {len(project['packs'])} packs"
    )


def has_entries(root: Path) -> bool:
    """Whether `root` holds anything (one directory read; most jobs leave it empty)."""
    try:
        with os.scandir(root) as entries:
            return next(entries, None) is not None
    except FileNotFoundError:
        return False


def files_under(root: Path) -> list[tuple[str, Path]]:
    """Regular files under root (symlinks are not followed: a job cannot export the worker's files)."""
    out: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink():
                out.append((path.relative_to(root).as_posix(), path))
    return out


async def log_pages(queue: PoolLink, job_id: str) -> AsyncIterator[bytes]:
    """The job's log as stored (every attempt's output, in order), a page of entries at a time:
    never more of it in memory than one page (LOG_PAGE chunks of at most 64 KiB)."""
    after = "0-0"
    while chunks := await queue.read_log(job_id, after, count=LOG_PAGE):
        yield b"".join(data for _, data in chunks)
        after = chunks[-1][0]


async def _upload_log(store: ObjectStore, queue: PoolLink, job_id: str, key: str) -> dict[str, Any] | None:
    """Stream the job's log to `key`; its description, or None when it is empty."""
    pages = log_pages(queue, job_id)
    first = await anext(pages, b"")
    if not first:
        return None

    async def everything() -> AsyncIterator[bytes]:
        yield first
        async for page in pages:
            yield page

    info = await store.put_stream(key, everything())
    return {"size": info.size, "key": info.key, "sha256": info.sha256}


async def upload_artifacts(
    store: ObjectStore, queue: PoolLink, lease: Lease, output: Path | None, *, logged: bool = True
) -> dict[str, Any]:
    """Upload the attempt's outputs (those in `output`; None: it is known to have left none) and
    the job's log (when there is any: `logged=False` says this attempt wrote none, so a first
    attempt's log is known to be empty without reading it); the `result` entries that describe
    them."""
    prefix = artifact_prefix(lease.job_id, lease.id)
    artifacts: list[dict[str, Any]] = []
    errors: list[str] = []
    files = await asyncio.to_thread(files_under, output) if output is not None and has_entries(output) else []
    for name, path in files:
        try:
            info = await store.put_file(prefix + "out/" + name, path)
        except (InvalidKey, StorageError, OSError) as exc:
            errors.append(f"{name}: {exc}")
            continue
        artifacts.append({"name": name, "size": info.size, "key": info.key, "sha256": info.sha256})
    result: dict[str, Any] = {"artifacts": artifacts}
    try:
        if (logged or lease.attempt > 1) and (
            described := await _upload_log(store, queue, lease.job_id, prefix + "log")
        ):
            result["log"] = described
    except (StorageError, GpupoolError, *UNREACHABLE) as exc:  # the outcome matters more than its log's copy
        errors.append(f"log: {exc}")
    if errors:
        result["artifact_errors"] = errors
        log.warning("job %s attempt %d: %d artifacts not uploaded", lease.job_id, lease.attempt, len(errors))
    return result
