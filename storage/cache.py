"""The worker's content-addressed cache: datasets fetched once, kept under a size cap, LRU-evicted.

Layout under `root`:

    objects/<sha256>   the verified bytes, read-only (hard-linked into the directories of jobs
                       that run as another uid; copied for jobs that run as the cache's owner)
    used/<sha256>      empty file whose mtime is the last use: our LRU clock. Not atime, which
                       `noatime`/`relatime` mounts do not keep and any reader of the object changes.
    locks/<sha256>     flock'd by the one process downloading that object
    evict.lock         flock'd by whoever evicts
    tmp/               downloads in progress; renamed into objects/ once verified

Two fetches of one object in the same process share one download (an asyncio future per sha256);
two processes (two workers on one machine) serialise on the object's lock file, and the second one
finds the object in place when it gets the lock. An object is published with a rename only after
its sha256 matched the name it is stored under, so `objects/` never holds a partial or wrong file.
Eviction never removes an object pinned by `use()` in this process. An object already hard-linked
into a job directory survives eviction anyway (the link keeps the inode).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

from storage.base import ChecksumMismatch, ObjectStore
from storage.content import content_key

log = logging.getLogger(__name__)

# Objects are read-only. A root worker's jobs run as slot uids, which read them through hard links:
# readable by all (under a data directory others may only pass, never list). A worker that does not
# run as root runs its jobs as itself: its owner alone reads them.
READABLE = 0o444 if os.geteuid() == 0 else 0o400
FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int), share src's blocks with dest
COPY_CHUNK = 1 << 20


class ObjectCache:
    """A size-capped cache of `store` objects keyed by sha256.

    `downloads` counts the objects actually fetched from the store (tests prove hits with it).
    """

    def __init__(self, root: Path, store: ObjectStore, max_bytes: int) -> None:
        self.root = Path(root)
        self.store = store
        self.max_bytes = max_bytes
        self.downloads = 0
        self._objects = self.root / "objects"
        self._used = self.root / "used"
        self._locks = self.root / "locks"
        self._tmp = self.root / "tmp"
        for d in (self._objects, self._used, self._locks, self._tmp):
            d.mkdir(parents=True, exist_ok=True)
        self._inflight: dict[str, asyncio.Task[Path]] = {}
        self._pins: Counter[str] = Counter()

    def path(self, sha256: str) -> Path:
        content_key(sha256)  # validates the name: it becomes a path
        return self._objects / sha256

    def __contains__(self, sha256: str) -> bool:
        return self.path(sha256).exists()

    def size(self) -> int:
        """Bytes held in `objects/`."""
        return sum(p.stat().st_size for p in self._objects.iterdir())

    async def fetch(self, sha256: str, key: str | None = None) -> Path:
        """The path of the object with this sha256, downloading it from `key` (default: its
        content key) if it is not cached. The path is read-only; link or copy it, don't write it."""
        path = self.path(sha256)
        if path.exists():
            self._touch(sha256)
            return path
        task = self._inflight.get(sha256)
        if task is None:
            task = asyncio.ensure_future(self._download(sha256, key or content_key(sha256)))
            self._inflight[sha256] = task
            task.add_done_callback(lambda t: self._done(sha256, t))
        # Shielded: one waiter giving up must not cancel the download the others wait for.
        return await asyncio.shield(task)

    def _done(self, sha256: str, task: asyncio.Task[Path]) -> None:
        self._inflight.pop(sha256, None)
        if not task.cancelled() and task.exception() is not None:
            log.debug("fetch of %s failed: %s", sha256, task.exception())

    async def place(self, sha256: str, dest: Path, key: str | None = None, *, private: bool = False) -> Path:
        """Put the object at `dest` (a job's input): a hard link when the filesystem allows, a
        copy otherwise. A hard link is read-only, like the cache entry it shares an inode with, to
        a job whose uid does not own that inode (a root worker's slot uid). `private`: the job runs
        as the cache's owner, who may `chmod u+w` any inode it owns, so it gets an inode of its
        own (`private_copy`): sharing the entry's would let it change the bytes every later job,
        and every job reading them at the same time, takes for verified."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            src = await self.fetch(sha256, key)
            try:
                if private:
                    await asyncio.to_thread(private_copy, src, dest)
                else:
                    os.link(src, dest)
            except FileNotFoundError:
                continue  # evicted by another process between fetch and link: fetch again
            except OSError as e:
                if e.errno not in {errno.EXDEV, errno.EPERM, errno.EMLINK}:
                    raise
                await asyncio.to_thread(shutil.copyfile, src, dest)
            return dest
        raise FileNotFoundError(f"cache entry {sha256} vanished twice while being placed")

    @contextlib.asynccontextmanager
    async def use(self, sha256: str, key: str | None = None) -> AsyncIterator[Path]:
        """Fetch and pin: eviction in this process leaves the object alone until the block ends."""
        self._pins[sha256] += 1
        try:
            yield await self.fetch(sha256, key)
        finally:
            self._pins[sha256] -= 1
            if not self._pins[sha256]:
                del self._pins[sha256]
                # Eviction may have skipped this object while it was pinned: catch up now.
                await self.evict()

    async def evict(self) -> None:
        """Evict least recently used objects, not pinned ones, until the cache fits its cap."""
        await asyncio.to_thread(self._evict, frozenset(self._pins))

    async def close(self) -> None:
        """Cancel downloads still running (their waiters have all gone)."""
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- the download, under the cross-process lock ---------------------------------------------

    async def _download(self, sha256: str, key: str) -> Path:
        path = self.path(sha256)
        fd = os.open(self._locks / sha256, os.O_CREAT | os.O_RDWR, 0o644)
        await _lock(fd)
        try:
            if path.exists():  # another process fetched it while we waited for the lock
                self._touch(sha256)
                return path
            tmp = Path(tempfile.mkdtemp(dir=self._tmp)) / sha256
            try:
                info = await self.store.get_file(key, tmp)
                self.downloads += 1
                if info.sha256 != sha256:
                    raise ChecksumMismatch(key, sha256, str(info.sha256))
                tmp.chmod(READABLE)
                os.replace(tmp, path)
            finally:
                shutil.rmtree(tmp.parent, ignore_errors=True)
            self._touch(sha256)
        finally:
            os.close(fd)  # releases the flock
        pins = frozenset(self._pins) | {sha256}
        await asyncio.to_thread(self._evict, pins)
        return path

    def _touch(self, sha256: str) -> None:
        stamp = self._used / sha256
        now = time.time_ns()
        try:
            os.utime(stamp, ns=(now, now))
        except FileNotFoundError:
            stamp.touch()
            os.utime(stamp, ns=(now, now))

    def _evict(self, keep: frozenset[str]) -> None:
        """Remove least recently used objects until the total fits `max_bytes` (blocking)."""
        with open(self.root / "evict.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries: list[tuple[int, str, int]] = []
            for obj in self._objects.iterdir():
                try:
                    size = obj.stat().st_size
                    used = (self._used / obj.name).stat().st_mtime_ns
                except FileNotFoundError:
                    used = 0  # no stamp: treat as oldest
                entries.append((used, obj.name, size))
            total = sum(size for _, _, size in entries)
            for _, name, size in sorted(entries):
                if total <= self.max_bytes:
                    break
                if name in keep:
                    continue
                log.info("cache: evicting %s (%d bytes) to stay under %d bytes", name, size, self.max_bytes)
                for p in (self._objects / name, self._used / name, self._locks / name):
                    p.unlink(missing_ok=True)
                total -= size
            if total > self.max_bytes:
                log.warning("cache over its cap (%d > %d bytes): pinned objects", total, self.max_bytes)


def private_copy(src: Path, dest: Path) -> None:
    """Copy `src` to a new file `dest` (never one already there), readable by its owner alone (the
    job's uid is the cache's: no one else needs it): a reflink where the file system offers one
    (FICLONE: btrfs, XFS, bcachefs; no bytes move, the blocks are shared until one side writes,
    and then copied for that side alone), else the bytes."""
    with open(src, "rb") as source, open(dest, "xb") as target:
        try:
            fcntl.ioctl(target.fileno(), FICLONE, source.fileno())
        except OSError:  # not this file system's (ext4, tmpfs), or across two: copy
            _copy_bytes(source, target)
        os.fchmod(target.fileno(), 0o400)


def _copy_bytes(source: BinaryIO, target: BinaryIO) -> None:
    """Copy in the kernel (copy_file_range: no pass through this process's memory), or through
    it where the kernel cannot (across file systems before Linux 5.3)."""
    left = os.fstat(source.fileno()).st_size
    try:
        while left > 0 and (done := os.copy_file_range(source.fileno(), target.fileno(), left)):
            left -= done
    except OSError:
        if target.tell():
            raise
        shutil.copyfileobj(source, target, COPY_CHUNK)


async def _lock(fd: int) -> None:
    """Take an exclusive flock on `fd` without blocking the event loop.

    If the waiting coroutine is cancelled, the thread still blocked in flock() closes the fd once
    it gets the lock, so the lock is never left held by nobody.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    fut = asyncio.get_running_loop().run_in_executor(None, fcntl.flock, fd, fcntl.LOCK_EX)
    try:
        await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(lambda _: os.close(fd))
        raise
    except BaseException:
        os.close(fd)
        raise
