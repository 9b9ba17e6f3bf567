"""What a slot's uid leaves on the machine after its attempt: processes, files in the shared
temporary and lock directories, System V IPC objects. The next job of the uid is another user's, so each
goes with the attempt (spawn.py calls these at its end, and at a worker's start for what a worker
that died left).

Processes are killed as the uid itself (_spawn.sweep: kill(-1) reaches all of them in one system
call, and a process with SIGKILL pending cannot finish a fork, so no fork loop outruns it), then
looked for in /proc until none is alive. A zombie is not alive: it runs no code and holds nothing
but its pid, and whether it is reaped is its parent's business (or init's).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import time
from collections.abc import Callable

from daemon.worker.native import _spawn

# The machine's directories every uid may write: temporary files, lock files (/run/lock, which
# /var/lock names), and POSIX message queues where mounted (a job with an IPC namespace of its own
# makes its queues there, and they go with it).
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")  # noqa: S108 - swept, never written
MTIME_SLACK_NS = 100_000_000  # a directory's times move in ticks of the coarse clock (<= 10 ms)
IPC_RMID = 0
LIBC = ctypes.CDLL(None, use_errno=True)  # the System V *ctl calls
SYSV_UID_COLUMNS = {"shm": (7, 9), "sem": (4, 6), "msg": (7, 9)}  # /proc/sysvipc/KIND: uid, cuid
SYSV_REMOVE: dict[str, Callable[[int], int]] = {  # IPC_RMID an object of each kind, by its id
    "shm": lambda n: LIBC.shmctl(n, IPC_RMID, None),
    "sem": lambda n: LIBC.semctl(n, 0, IPC_RMID),
    "msg": lambda n: LIBC.msgctl(n, IPC_RMID, None),
}

Swept = dict[
    tuple[int, str], int
]  # (uid, directory) -> its mtime when last found holding nothing of the uid's


def shared_changed(uid: int, swept: Swept) -> bool:
    """Whether any shared temporary directory may hold something new of `uid`'s: its modification
    time moved since it was last found holding nothing of the uid's (a stat each: the common case
    needs no `sweep_shared`)."""
    for top in SHARED_TMP:
        try:
            if swept.get((uid, top)) != os.stat(top).st_mtime_ns:
                return True
        except OSError:
            continue
    return False


def sweep_shared(uid: int, swept: Swept) -> None:
    """Remove what `uid` left at the top of the machine's shared temporary directories (its own
    files, directories and links; a directory's whole tree, links in it unlinked, never
    followed). Its processes are killed by now (they run no more code). Blocking: a thread.

    A directory whose modification time has not moved since its last sweep for `uid` gained no
    entry since, so it is not read again (`swept`). Only a time older than the sweep by more than
    the clock's granularity counts (MTIME_SLACK_NS): an entry made in the same tick as the last
    change would not move it."""
    for top in SHARED_TMP:
        try:
            before = os.stat(top).st_mtime_ns
            if swept.get((uid, top)) == before:
                continue
            now = time.time_ns()
            with os.scandir(top) as scan:
                entries = [e for e in scan if owned_by(e, uid)]
        except OSError:
            continue
        for entry in entries:
            # rmtree walks by descriptor, never following a link (one swapped in meanwhile by
            # another uid's job included), and root reads even what the job made unreadable.
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
        if not entries and before < now - MTIME_SLACK_NS:
            swept[(uid, top)] = before
        else:
            swept.pop((uid, top), None)  # what was removed moved it: read it next time


def sweep_ipc(uid: int) -> None:
    """Remove the System V shared memory, semaphores and message queues `uid` owns or made: they
    outlive their processes."""
    if not _spawn.sysv_objects():
        return  # mostly: three system calls, far cheaper than reading the tables
    for kind, (owner, creator) in SYSV_UID_COLUMNS.items():
        try:
            with open(f"/proc/sysvipc/{kind}") as table:
                rows = [line.split() for line in table.read().splitlines()[1:]]
        except OSError:
            continue
        for row in rows:
            if uid in (int(row[owner]), int(row[creator])):
                SYSV_REMOVE[kind](int(row[1]))


def owned_by(entry: os.DirEntry[str], uid: int) -> bool:
    """Whether `entry` is `uid`'s; one that went meanwhile (another job's churn) is not."""
    try:
        return entry.stat(follow_symlinks=False).st_uid == uid
    except OSError:
        return False


def alive(uid: int) -> list[int]:
    """The pids of `uid`'s processes that are not zombies, from /proc."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rpartition(b")")[2].split()[0]
            if state not in (b"Z", b"X"):
                pids.append(int(name))
    return pids
