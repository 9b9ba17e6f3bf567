"""Who a slot's jobs run as: a uid and gid of their own, never the daemon's (docs/SECURITY.md).

A worker running as root with `job_uid_range = "A-B"` gives slot N the uid and gid A+N. Every job of
that slot runs under it with no capabilities (inheritable, ambient and bounding sets empty) and
`no_new_privs`, so it cannot read the daemon's 0600 secrets, reach another slot's job through
/proc or signals, or gain privileges through a setuid program; when its attempt ends, every
process of that uid is killed (leftovers.py), which ends what escaped with `setsid` or `env -i`.

The switch is made by exec'ing util-linux's `setpriv` in front of the job, not in the child
between fork and exec: CPython starts a child with vfork (spawn.py) only when it changes no
credentials, and a fork of a large worker costs ~20 ms a job; vfork + exec of setpriv, which then
execs the job, costs two execs (~1 ms). Without a range, jobs run as the daemon's own user: right
on a machine that is one person's own, and said once at start when poold runs as root.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from daemon.config import uid_range_of
from daemon.errors import GpupoolError


class IdentityError(GpupoolError):
    """The configured job identities cannot be used on this machine."""


@dataclass(frozen=True, slots=True)
class SlotIdentity:
    """The uid and gid one slot's jobs run as, and the setpriv that switches to them."""

    uid: int
    gid: int
    setpriv: str

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """`argv` to exec so that it runs as this identity, without capabilities or new privileges."""
        return [
            self.setpriv,
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--ambient-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "--",
            *argv,
        ]

    def own(self, *paths: Path) -> None:
        """Give `paths` (not what is under them) to this identity: the slot's own directories."""
        for path in paths:
            os.chown(path, self.uid, self.gid)

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
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise IdentityError("job_uid_range needs util-linux's setpriv on PATH (apt install util-linux)")
    return [SlotIdentity(uids[n], uids[n], setpriv) for n in range(slots)]
