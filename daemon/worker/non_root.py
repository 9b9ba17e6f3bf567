"""What a worker that does not run as root does to keep the pool's credentials from its jobs.

Such a worker (a pilot on a batch cluster, a user's own `poold --worker`) cannot switch uids: every
job it runs runs as the worker's own user, and may read whatever that user may, its config file
with the pool's Redis password and S3 keys included. So it serves one pool user only
(`worker_serve_user`, docs/DESIGN.md "Workers that do not run as root"): a job can then read no
credential its own user did not hand the worker. (The local slots of a server that is not root
hold to the same rule: server/service.py, `refuse_shared_local_slots`.) Beside that, in depth:

- the worker process is made non-dumpable as soon as it starts (`make_non_dumpable`): the kernel
  then gives its /proc files to root and refuses a process of the same uid its environ, mem, fd,
  cwd and ptrace, so a job cannot take the worker's secrets from its memory or its open files;
- its data directory (the pilot's node-local tree: scratch and the dataset cache) must be its own
  and closed to everyone else (`check_data_dir`), so no other user on the node reads the data of
  the pool user it serves, and no directory planted there first is used.
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat
from pathlib import Path

from daemon.config import Config
from daemon.errors import GpupoolError

log = logging.getLogger(__name__)

PR_SET_DUMPABLE = 4  # <linux/prctl.h>


class NonRootWorkerError(GpupoolError):
    """A worker that does not run as root is configured in a way that would hand one user's jobs
    another's credentials or data; the sentence says what to set."""


def runs_as_root() -> bool:
    return os.geteuid() == 0


def make_non_dumpable() -> None:
    """prctl(PR_SET_DUMPABLE, 0) on this process: no process of its uid may ptrace it or read its
    /proc environ, mem, fd or cwd (root may). A job exec'd by it is dumpable again (execve resets
    the flag for a program its user may read), so a job's own tools still see the job."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise NonRootWorkerError(f"cannot make the worker non-dumpable: {os.strerror(err)}")


def check_serve_user(config: Config) -> None:
    """Refuse a worker that does not run as root and would serve every pool user's jobs; say at
    every start of one that serves one user that its jobs can read the pool's credentials."""
    if runs_as_root() or config.embedded:
        return
    if not config.worker_serve_user:
        raise NonRootWorkerError(
            "this worker does not run as root, so it runs every job as its own user, and any job could "
            "read its config (the pool's Redis password and S3 keys): run it as an agent of the pool "
            "server (worker_via_server, worker_token_file: it then holds only a user's token), or set "
            "worker_serve_user (--serve-user USER, GPUPOOL_WORKER_SERVE_USER) to the one pool user whose "
            "jobs it may run, trusted with those credentials, or run it as root with job_uid_range"
        )
    log.warning(
        "this worker does not run as root and holds the pool's Redis password and S3 keys, which "
        "%s's jobs here can read: an agent (worker_via_server, worker_token_file) holds only a token",
        config.worker_serve_user,
    )


def check_data_dir(path: Path) -> None:
    """A worker that does not run as root keeps its data under a directory of its own uid that no
    one else may enter (config.make_data_dir makes a missing one so, mode 0700); another's, or one
    group or others may open, is refused: it may have been planted there, or show the data to
    others."""
    if runs_as_root():
        return
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise NonRootWorkerError(f"the data directory {path} is not a directory: give data_dir elsewhere")
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise NonRootWorkerError(
            f"the data directory {path} (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):03o}) must be "
            f"this worker's own (uid {os.geteuid()}) and closed to others, mode 700: it holds the jobs' "
            f"data and the dataset cache; give data_dir a new path (mktemp -d) or chmod 700 it if it "
            "is yours"
        )
