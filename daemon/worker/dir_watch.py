"""Which of a worker's slot directories anything has changed since the worker last made them new.

Each job gets its slot's directories empty and as new (scratch.py). Making sure of that took a
look at each directory before the job and after it: an lstat, a directory read and an xattr
list, seven system calls a directory, for every job, on the worker's one event loop, paid even
by the most common job of all, one that leaves its directories as it found them.

The kernel says it instead. An inotify watch on each directory reports every change to it, by any
process: an entry made, removed or renamed in it (IN_CREATE, IN_DELETE, IN_MOVED_*), its mode,
owner or ACL changed (IN_ATTRIB), the directory itself moved or removed (IN_MOVE_SELF,
IN_DELETE_SELF). A directory made new is empty, so nothing can change inside it without one of
those first. The event is queued by the very system call that makes the change, so once a job's
processes are gone every change they made is in the queue; reading an empty queue is one system
call. A directory with no event since it was made new is therefore as it was then. When the
queue overflows (IN_Q_OVERFLOW: events were lost) every directory counts as changed, and where
inotify cannot be had (no instance left for this uid, say) every one always does, as before.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from inotify_simple import INotify, flags

log = logging.getLogger(__name__)

CHANGES = (
    flags.CREATE
    | flags.DELETE
    | flags.MOVED_FROM
    | flags.MOVED_TO
    | flags.ATTRIB
    | flags.MOVE_SELF
    | flags.DELETE_SELF
    | flags.ONLYDIR
    | flags.DONT_FOLLOW
)


class DirWatch:
    """The directories made new (`made_new`) that nothing has changed since (`untouched`).
    `close()` at the end."""

    def __init__(self) -> None:
        try:
            self._inotify: INotify | None = INotify(nonblocking=True)
        except OSError as exc:
            log.warning("no inotify (%s): every slot directory is looked at before and after each job", exc)
            self._inotify = None
        self._paths: dict[int, Path] = {}  # watch descriptor -> directory
        self._untouched: set[Path] = set()
        self._refused = False  # a watch was refused (and said so)

    def made_new(self, path: Path) -> None:
        """`path` has just been made new by the caller, and nothing else may change it meanwhile:
        from now on a change to it counts (the caller's own, queued before, do not)."""
        if self._inotify is None:
            return
        try:
            wd = self._inotify.add_watch(path, CHANGES)
        except OSError as exc:  # gone again, or no watch left for this uid: looked at each time
            if not self._refused:  # once: a reset follows every job of the slot
                log.warning("cannot watch %s (%s): it is looked at after each job", path, exc)
                self._refused = True
            self._untouched.discard(path)
            return
        for old in [w for w, p in self._paths.items() if p == path and w != wd]:
            del self._paths[old]  # a directory that was there before (moved away by a job, say)
            with contextlib.suppress(OSError):  # (removed: its watch went with it)
                self._inotify.rm_watch(old)
        self._paths[wd] = path
        self._read()
        self._untouched.add(path)

    def untouched(self, *paths: Path) -> bool:
        """Nothing has changed any of `paths` since each was last made new."""
        self._read()
        return self._untouched.issuperset(paths)

    def _read(self) -> None:
        """Take in the events queued so far: each marks its directory changed."""
        if self._inotify is None:
            return
        for event in self._inotify.read(timeout=0):
            if event.mask & flags.Q_OVERFLOW:
                self._untouched.clear()
                continue
            path = self._paths.get(event.wd)
            if path is not None:
                self._untouched.discard(path)
            if event.mask & flags.IGNORED:  # the directory is gone: its watch with it
                self._paths.pop(event.wd, None)

    def close(self) -> None:
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
        self._untouched.clear()
