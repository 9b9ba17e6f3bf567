"""Who a slot's jobs run as: a uid and gid of their own, never the daemon's (docs/SECURITY.md).

A worker running as root with `job_uid_range = "A-B"` gives slot N the uid and gid A+N. Every job of
that slot runs under it with no capabilities (inheritable, ambient and bounding sets empty) and
`no_new_privs`, so it cannot read the daemon's 0600 secrets, reach another slot's job through
/proc or signals, or gain privileges through a setuid program; when its attempt ends, every
process of that uid is killed (leftovers.py), which ends what escaped with `setsid` or `env -i`.

The switch is made by exec'ing util-linux's `setpriv` in front of the job, not in the child
between fork and exec: CPython starts a child with vfork (spawn.py) only when it changes no
credentials, and a fork of a large worker costs ~20 ms a job; vfork + exec of setpriv costs an
exec (~1 ms). setpriv runs as root, so nothing of the job reaches it: it starts with a fixed
environment (a job's LD_PRELOAD would otherwise run as root inside it), and only once it has
switched does `env -i --chdir` give the job its environment and directory, as the slot's uid (a
chdir made as root would pass directories the uid may not). Without a range, jobs run as the
daemon's own user: right on a machine that is one person's own, and said once at start when poold
runs as root.

At the end of an attempt, `kill_all` signals every process of the uid *as that uid*: kill(-1)
reaches them all in one system call, and a process with SIGKILL pending cannot finish a fork, so
no fork loop outruns it (a sweep over /proc can be: each pass lists pids that have already forked).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from daemon.config import uid_range_of
from daemon.errors import GpupoolError


class IdentityError(GpupoolError):
    """The configured job identities cannot be used on this machine."""


# The whole environment setpriv (root, before the switch) and the kill helper get.
ROOT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
# As the slot's uid: kill(-1) signals every process of the uid but the caller in one pass of the
# kernel's task list, and a fork racing it fails (its parent has SIGKILL pending), so one suffices;
# a second costs nothing. (kill(-1) says nothing useful: it succeeds whenever any process exists.)
KILL_ALL = "kill -KILL -1 2>/dev/null; kill -KILL -1 2>/dev/null; exit 0"


@dataclass(frozen=True, slots=True)
class SlotIdentity:
    """The uid and gid one slot's jobs run as, and the programs that switch to them."""

    uid: int
    gid: int
    setpriv: str
    env: str  # coreutils env: the job's environment and directory, applied after the switch
    sh: str

    def _switch(self) -> list[str]:
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
        ]

    def wrap(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> list[str]:
        """What to exec (with ROOT_ENV) so that `argv` runs as this identity, without capabilities
        or new privileges, in `cwd` with exactly `env`."""
        assignments = [f"{k}={v}" for k, v in env.items()]
        return [*self._switch(), self.env, "-i", f"--chdir={cwd}", *assignments, *argv]

    def kill_all(self) -> None:
        """SIGKILL every process running as this identity's uid. Blocking (an exec, ~2 ms)."""
        subprocess.run([*self._switch(), self.sh, "-c", KILL_ALL], env=ROOT_ENV, check=False, timeout=30)

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
    setpriv, env, sh = shutil.which("setpriv"), shutil.which("env"), shutil.which("sh")
    if setpriv is None or env is None or sh is None:
        raise IdentityError("job_uid_range needs util-linux's setpriv, coreutils' env and sh on PATH")
    return [SlotIdentity(uids[n], uids[n], setpriv, env, sh) for n in range(slots)]


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
