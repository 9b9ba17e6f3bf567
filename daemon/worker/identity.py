"""Who a slot's jobs run as: a uid and gid of their own, never the daemon's (docs/SECURITY.md).

A worker running as root with `job_uid_range = "A-B"` gives slot N the uid and gid A+N. Every job of
that slot runs under it with no capabilities (inheritable, ambient and bounding sets empty) and
`no_new_privs`, so it cannot read the daemon's 0600 secrets, reach another slot's job through
/proc or signals, or gain privileges through a setuid program; when its attempt ends, every
process of that uid is killed (leftovers.py), which ends what escaped with `setsid` or `env -i`.

The job's first process makes the switch itself (_spawn.c), before the chdir and the exec, so the
job's directory is entered as the uid (a chdir made as root would pass directories the uid may
not). Without a range, jobs run as the daemon's own user: right on a machine that is one
person's own, and said once at start when poold runs as root.

At the end of an attempt every process of the uid is signalled *as that uid* (uid_sweep.py): kill(-1)
reaches them all in one system call, and a process with SIGKILL pending cannot finish a fork, so
no fork loop outruns it (a sweep over /proc can be: each pass lists pids that have already forked).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from daemon.config import uid_range_of
from daemon.errors import GpupoolError


class IdentityError(GpupoolError):
    """The configured job identities cannot be used on this machine."""


@dataclass(frozen=True, slots=True)
class SlotIdentity:
    """The uid and gid one slot's jobs run as."""

    uid: int
    gid: int

    def own_tree(self, top: Path) -> None:
        """Give `top` and what is under it to this identity (a checkout, an unpacked snapshot), all
        but files with other hard links: those are the worker's cached inputs, which a job reads
        and must never own (it could change them for the next job). Blocking: run it in a thread."""
        os.chown(top, self.uid, self.gid, follow_symlinks=False)
        for root, dirs, files in os.walk(top):
            for name in dirs:
                os.chown(os.path.join(root, name), self.uid, self.gid, follow_symlinks=False)
            for name in files:
                path = os.path.join(root, name)
                if os.lstat(path).st_nlink == 1:
                    os.chown(path, self.uid, self.gid, follow_symlinks=False)


def slot_identities(uid_range: str, slots: int) -> list[SlotIdentity] | None:
    """One identity per slot from `uid_range` ("" : jobs run as the daemon's own user, None)."""
    if not uid_range:
        return None
    uids = uid_range_of(uid_range)
    if os.geteuid() != 0:
        raise IdentityError(
            f"job_uid_range = {uid_range!r} needs poold to run as root (it switches each job to "
            "its slot's uid); leave it empty to run jobs as this user"
        )
    if slots > len(uids):
        raise IdentityError(
            f"job_uid_range = {uid_range!r} holds {len(uids)} uids for {slots} slots: give each slot one"
        )
    return [SlotIdentity(uids[n], uids[n]) for n in range(slots)]


def check_passable(path: Path) -> None:
    """A job's uid must pass through every directory above its slot's, as itself: IdentityError
    naming the first that others may not pass (`chmod o+x` it, or move data_dir)."""
    for directory in [path.resolve(), *path.resolve().parents]:
        mode = directory.stat().st_mode
        if not mode & stat.S_IXOTH:
            raise IdentityError(
                f"the jobs' uids cannot pass through {directory} (mode {stat.S_IMODE(mode):o}) to reach "
                f"their directories under {path}: chmod o+x it, or give data_dir elsewhere"
            )
