"""Who a slot's jobs run as: a uid and gid of their own, never the daemon's (docs/SECURITY.md).

A worker running as root with `job_uid_range = "A-B"` gives slot N the uid and gid A+N. Every job of
that slot runs under it with no capabilities (inheritable, ambient and bounding sets empty) and
`no_new_privs`, so it cannot read the daemon's 0600 secrets, reach another slot's job through
/proc or signals, or gain privileges through a setuid program; when its attempt ends, every
process of that uid is killed (leftovers.py), which ends what escaped with `setsid` or `env -i`.

Safe by default: a root worker given no range leases one uid per slot from DEFAULT_UIDS (above the
61000-61063 the shipped unit gives its worker), each held by an flock on a file under UID_LEASES
for as long as this process lives, so that two poolds on one machine (a worker and an embedded
pool's local slots, two `make run`s) never share a uid: a poold starting sweeps its uids
(uid_sweep.py), which would end the other's jobs. Jobs run as root only where the operator says so,
`job_uid_range = "root"`, and the worker says so at every start. A worker that is not root runs its
jobs as its own user: right on a machine that is one person's own (said once at start).

The job's first process makes the switch itself (_spawn.c), before the chdir and the exec, so the
job's directory is entered as the uid (a chdir made as root would pass directories the uid may
not).

At the end of an attempt every process of the uid is signalled *as that uid* (uid_sweep.py): kill(-1)
reaches them all in one system call, and a process with SIGKILL pending cannot finish a fork, so
no fork loop outruns it (a sweep over /proc can be: each pass lists pids that have already forked).
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from daemon.errors import GpupoolError
from daemon.option_values import ROOT, uid_range_of

log = logging.getLogger(__name__)

# Where a root worker given no job_uid_range takes its slots' uids from: above the shipped unit's
# 61000-61063 (61000-61999 are left to the ranges operators give), below nobody's 65534.
DEFAULT_UIDS = range(62000, 65534)
UID_LEASES = Path("/run/gpupool/uids")  # root's: /run is root's alone, and a tmpfs
_HELD: list[int] = []  # the descriptors holding this process's leases, never closed


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
    """Who the jobs of `slots` slots run as: one identity per slot, or None where they run as the
    daemon's own user (`job_uid_range = "root"`, or a daemon that is not root, which cannot
    switch). A range with fewer uids than `slots` gives as many identities as it has uids: the
    worker runs that many slots."""
    root = os.geteuid() == 0
    if uid_range == ROOT:
        if not root:  # a config shared with root workers: nothing to refuse, nothing to switch
            log.warning('job_uid_range = "root", and this poold is not root: its jobs run as its own user')
        return None
    if not uid_range:
        return [SlotIdentity(uid, uid) for uid in lease_uids(slots)] if root else None
    if not root:
        raise IdentityError(
            f"job_uid_range = {uid_range!r} needs poold to run as root (it switches each job to "
            "its slot's uid); leave it empty to run jobs as this user"
        )
    return [SlotIdentity(uid, uid) for uid in uid_range_of(uid_range)[:slots]]


def lease_uids(count: int, directory: Path = UID_LEASES) -> list[int]:
    """`count` uids of DEFAULT_UIDS that no other process on this machine holds, held by this one
    until it exits (an flock on `directory`/UID each, on a descriptor never closed: the kernel
    lets go of it when the process ends, however it ends). IdentityError when there are not
    enough, or the directory is not root's alone."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = directory.lstat()
    except OSError as exc:
        raise IdentityError(
            f"cannot lease slot uids under {directory} ({exc.strerror}): set job_uid_range to a "
            "range of uids for this poold's jobs alone"
        ) from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise IdentityError(f"{directory} must be a directory of root's that only root may write")
    held: dict[int, int] = {}  # uid: the descriptor holding it
    for uid in DEFAULT_UIDS:
        if len(held) == count:
            break
        fd = os.open(directory / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # another poold's (or another worker's of this process)
            continue
        held[uid] = fd
    if len(held) < count:
        for fd in held.values():
            os.close(fd)
        raise IdentityError(
            f"only {len(held)} of the uids {DEFAULT_UIDS.start}-{DEFAULT_UIDS.stop - 1} are free on "
            f"this machine for {count} slots: set job_uid_range, or fewer slots"
        )
    _HELD.extend(held.values())
    return list(held)


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
