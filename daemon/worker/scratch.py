"""Scratch directories: each slot of a worker has its own (`work`, a job's default cwd, `out`,
its GPUPOOL_OUTPUT, `ckpt`, its GPUPOOL_CHECKPOINT_DIR; `tmp` with a slot uid), as new for each
job: those a job changed (inotify says which: dir_watch.py) are reset after it, or before the
next job at the latest.

Reusing a slot's directories saves creating and removing them for every job (a metadata write
each, which a short job would pay for every directory); the reset makes that safe: a job
always starts in empty, real directories whatever the last one left (files, read-only trees, a
symlink in place of a directory), and in the state a new one would have. The last job owned them
and may have opened them to every uid (their mode, a default ACL): the next job of the slot is
maybe another user's, whose files another slot's job could then read.

The directories live under `slots/WORKER-ID/N` in the worker's data directory, so two workers
sharing a data directory (the server's local slots and a `poold --worker`) never share a slot. A
worker holds `slots/WORKER-ID.lock` (flock) while it runs; at start it removes the directories of
workers whose lock nobody holds any more (they died or stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import stat
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from daemon.worker.dir_watch import DirWatch


class SlotScratch:
    """One slot's directories (`work`, `out`, `ckpt`, `tmp` under `root`), and what the worker knows of
    them. Each job leaves them reset at its end, once nothing of it runs any more: they are then
    as new ones until the slot's next job starts. `watch` (dir_watch.py, shared by the worker's
    slots) tells which of them anything changed since: only those are looked at again (a look is
    an lstat, a directory read and an xattr list per directory, no small part of a short job's
    cost to the worker), before a job and after it. Without a watch, each one is looked at after
    every job. `owner`: the slot's (uid, gid), or None (the worker's own)."""

    def __init__(self, root: Path, owner: tuple[int, int] | None, watch: DirWatch | None = None) -> None:
        self.root = root
        self.work, self.out, self.tmp = root / "work", root / "out", root / "tmp"
        self.ckpt = root / "ckpt"
        self.owner = owner
        self.watch = watch
        self._fresh: set[Path] = set()  # reset, or handed over untouched, since a job last used them
        self._root_passable = False
        # A job's from its `take` or `prepare` to its `finish` (or `hand_over`); `_released` wakes
        # the `prepare` of the slot's next job, the one that may wait.
        self._in_use = False
        self._released = asyncio.Event()

    def take(self, dirs: Sequence[Path]) -> bool:
        """Before a job, with no wait: True when the slot is free and each of `dirs` surely as
        new (no look needed: the common short job's start); from now on the job may change
        them, as after `prepare`. False: `prepare` them."""
        if self._in_use or not all(self._as_new(path) for path in dirs):
            return False
        self._taken(dirs)
        return True

    async def prepare(self, dirs: Sequence[Path]) -> None:
        """Before a job: each of `dirs` as a new one (reset now, unless the last job's end did),
        once the last job's `finish` is done; from now on the job may change them. With an
        owner, the slot's own directory is made passable to it (mode 0711, whatever the umask)."""
        while self._in_use:
            self._released.clear()
            await self._released.wait()
        self._in_use = True
        for path in dirs:
            if not self._as_new(path):
                await self._reset(path)
        self._taken(dirs)

    def _taken(self, dirs: Sequence[Path]) -> None:
        self._in_use = True
        self._fresh.difference_update(dirs)
        if self.owner is not None and not self._root_passable:
            self.root.chmod(0o711)
            self._root_passable = True

    async def finish(self, dirs: Sequence[Path]) -> None:
        """After a job, nothing of it running any more: each of `dirs` back to a new one's state;
        then the slot's next job may have them."""
        try:
            for path in dirs:
                if not self._as_new(path):
                    await self._reset(path)
                self._fresh.add(path)
        finally:
            self._release()

    def hand_over(self, dirs: Sequence[Path]) -> bool:
        """After a job, nothing of it running any more: when it changed none of `dirs` (the watch
        says so), they are the slot's next job's at once, as `finish` would leave them, and True;
        the caller must not look at them again. Else False: `finish` them."""
        if self.watch is None or not self.watch.untouched(*dirs):
            return False
        self._fresh.update(dirs)
        self._release()
        return True

    def _release(self) -> None:
        self._in_use = False
        self._released.set()

    def _as_new(self, path: Path) -> bool:
        """Surely as a new directory is, with no look: reset since the last job used it, or
        unchanged since it was made new (the watch)."""
        return path in self._fresh or (self.watch is not None and self.watch.untouched(path))

    async def _reset(self, path: Path) -> None:
        # on the worker's own disk, mostly finding the directory as it should be: cheaper inline
        # than a hop to a thread; what a job left may take seconds to remove, so that in a thread
        if not reuse(path, self.owner):
            await asyncio.to_thread(remove, path)
            make(path, self.owner)
        if self.watch is not None:
            self.watch.made_new(path)


def reuse(path: Path, owner: tuple[int, int] | None) -> bool:
    """Make `path`, the directory the slot's last job had, what a new one would be: mode 0700,
    `owner`'s (uid, gid) when given, no ACL; made when it is not there. False when it holds
    anything or is not a directory: `remove` it (in a thread: it may take long), then `make` it.
    Most of the time an lstat, a directory read and an xattr list; a write only where a job
    changed something."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        make(path, owner)
        return True
    if not stat.S_ISDIR(st.st_mode) or not _empty(path):
        return False
    with contextlib.suppress(OSError):  # ENOTSUP: a filesystem without them
        for name in os.listxattr(path):
            if name.startswith("system.posix_acl_"):  # access and default: the mode bits are all
                os.removexattr(path, name)
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    if owner is not None and (st.st_uid, st.st_gid) != owner:
        os.chown(path, *owner)
    return True


def make(path: Path, owner: tuple[int, int] | None) -> None:
    """A new directory `path`, mode 0700, `owner`'s when given (its parents made as needed)."""
    path.mkdir(mode=0o700, parents=True)
    os.chmod(path, 0o700)  # whatever the umask took
    if owner is not None:
        os.chown(path, *owner)


def _empty(directory: Path) -> bool:
    with os.scandir(directory) as entries:
        return next(entries, None) is None


def remove(path: Path) -> None:
    """Remove `path` whatever it is, read-only trees included; what cannot be removed is moved
    aside (`NAME.stale-NS`) so that `path` itself is free. Blocking: run it in a thread."""

    def writable_and_retry(func: object, p: str, _exc: object) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o700)
            if not os.path.islink(p) and os.path.isdir(p):
                os.chmod(p, 0o700)
            func(p)  # type: ignore[operator]

    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, onerror=writable_and_retry)
    if os.path.lexists(path):
        with contextlib.suppress(OSError):
            path.rename(path.with_name(f"{path.name}.stale-{time.time_ns()}"))


class SlotDirs:
    """This worker's part of `root` (`data_dir/slots`): `open()` at start, `close()` at the end."""

    def __init__(self, root: Path, worker_id: str) -> None:
        self.root = root
        self.dir = root / worker_id
        self._lock: int | None = None

    def slot(self, n: int) -> Path:
        return self.dir / str(n)

    def open(self) -> list[str]:
        """Take this worker's lock, then remove what dead workers left; returns their ids.
        Blocking (a thread)."""
        dead = []
        self.root.mkdir(parents=True, exist_ok=True)
        with _locked(self.root / ".lock", blocking=True):  # one worker at a time does this
            self._lock = os.open(self.root / f"{self.dir.name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            for entry in list(self.root.iterdir()):
                if entry.name.startswith(".") or entry.suffix == ".lock" or entry == self.dir:
                    continue
                lock = entry.with_name(entry.name + ".lock")
                if lock.exists():
                    with _locked(lock, blocking=False) as free:
                        if not free:
                            continue  # a live worker's
                        remove(entry)
                        lock.unlink(missing_ok=True)
                else:
                    remove(entry)  # no lock: left by a worker of an older layout, or moved aside
                dead.append(entry.name)
        return dead

    def close(self) -> None:
        """Remove this worker's directories and give its lock up. Blocking (a thread)."""
        remove(self.dir)
        if self._lock is not None:
            (self.root / f"{self.dir.name}.lock").unlink(missing_ok=True)
            os.close(self._lock)
            self._lock = None


@contextlib.contextmanager
def _locked(path: Path, *, blocking: bool) -> Iterator[bool]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
