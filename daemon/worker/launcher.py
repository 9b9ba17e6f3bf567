"""The launcher: a small process of the worker's that starts its jobs, reaps them, and kills a slot's
uid, so that the worker's event loop never forks, execs or waits (spawn.py is the worker's side).

It is a program of its own, run as `python -I -S launcher.py FD HARDEN` with the standard library
and gpupool's one C module (_spawn.c) only: nothing of the worker's environment or sys.path reaches
it. It speaks over one SOCK_SEQPACKET socket, FD, one JSON message per datagram (requests may come
in several: a first byte "+" says more follow):

    (first, once it is ready)  -> {"ready": PID}
    {"op": "spawn", "id": N, "argv": [...], "env": {...}, "cwd": "...", "uid": U, "gid": G}
        -> {"id": N, "pid": P} with the read end of the job's output pipe attached (SCM_RIGHTS),
           sent once the exec has happened; or {"id": N, "errno": E} when it could not start.
        -> later {"exited": P, "status": S, "left": [PID...]} (S as subprocess gives it: -N for
           signal N; "left": what was still in the cgroup, killed, not yet gone), once
           what the job started has been sent SIGKILL (the attempt has ended: nothing of it may
           go on, setsid and `env -i` escapes included), without a round trip to the worker:
           given a cgroup ("cgroup": DIR, cgroups.py, which the child is born in, or joins
           before anything else) by one write to its cgroup.kill; else, given a uid, as that uid (kill(-1));
           with a uid, what it left in /tmp, /var/tmp and /dev/shm is removed too.
    {"op": "sweep", "id": N, "uid": U, "gid": G} -> {"id": N} once every process of U is sent
        SIGKILL and its temporary files are gone (a worker's start: its slots' uids may hold
        what a worker that died left).

A job's first process is started with vfork, and between vfork and exec it makes only system
calls (_spawn.c says which and why in C): the slot's cgroup, the default signal dispositions and
an empty mask, a session of its own (its group is its pid, so one killpg reaches what it starts),
stdin from /dev/null, stdout and stderr into one pipe, no other descriptor; then, given a uid, no
supplementary groups, the gid and uid (all three of each: nothing can switch back), and only then
the chdir, as the uid, into `cwd`, and exec with exactly `env` (PATH looked up in it). With
HARDEN=1 (a worker with slot uids) the launcher first gives up for good, for itself and so for
every job, the right to gain privileges on exec (no_new_privs: setuid programs and file
capabilities grant nothing), its bounding, inheritable and ambient capabilities: a job, once its
uid is not root, holds no capability and can gain none. The launcher keeps its effective ones,
which switching uids and killing need.

It leaves when the worker has left (end of file on the socket), never on a signal meant for the
worker, and kills the groups of the jobs it started first (what left them is the orphan guard's,
orphan_guard.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a program, with -I -S: its package is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from daemon.worker import _spawn, cgroups

MAX_FD = 2**31 - 1
MAX_DATAGRAM = 32 * 1024  # requests are cut into datagrams of this many bytes
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
# Signals meant for the worker (systemd's SIGTERM reaches every process of the unit), which the
# launcher ignores; a job's child sets every disposition back to the default. SIGCHLD is caught.
IGNORED = (signal.SIGPIPE, signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# The machine's temporary directories every uid may write (and POSIX message queues): what a
# slot's uid leaves there goes with its attempt (sweep_shared).
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue")  # noqa: S108 - swept, never written
DYING_POLL = 0.01  # how often to look again for a killed uid's processes, while some are left
DYING_SECONDS = 5.0  # how long to wait for them before telling the end with what is stuck
PR_SET_CHILD_SUBREAPER = 36
MTIME_SLACK_NS = 100_000_000  # a directory's times move in ticks of the coarse clock (<= 10 ms)
IPC_RMID = 0
LIBC = ctypes.CDLL(None, use_errno=True)  # prctl, capget/capset, the System V *ctl calls
SYSV_UID_COLUMNS = {"shm": (7, 9), "sem": (4, 6), "msg": (7, 9)}  # /proc/sysvipc/KIND: uid, cuid
SHM_INFO, SEM_INFO, MSG_INFO = 14, 19, 12  # <linux/shm.h>, <linux/sem.h>, <linux/msg.h>
# How many objects of each kind the machine has: the *_INFO command, and the int of its answer
# that counts them (shm_info.used_ids, seminfo.semusz, msginfo.msgpool).
SYSV_COUNTS: dict[str, tuple[Callable[[Any], int], int]] = {
    "shm": (lambda info: LIBC.shmctl(0, SHM_INFO, info), 0),
    "sem": (lambda info: LIBC.semctl(0, 0, SEM_INFO, info), 7),
    "msg": (lambda info: LIBC.msgctl(0, MSG_INFO, info), 0),
}
SYSV_REMOVE: dict[str, Callable[[int], int]] = {  # IPC_RMID an object of each kind, by its id
    "shm": lambda n: LIBC.shmctl(n, IPC_RMID, None),
    "sem": lambda n: LIBC.semctl(n, 0, IPC_RMID),
    "msg": lambda n: LIBC.msgctl(n, IPC_RMID, None),
}


def harden() -> None:
    """No privileges to gain on exec and no capabilities to pass on, for good (see above)."""
    if LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    cap = 0
    while LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # EINVAL past the last capability
        cap += 1
    LIBC.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL before Linux 4.3: none
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # two of {effective, permitted, inheritable}
    if LIBC.capget(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    data[2] = data[5] = 0
    if LIBC.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def candidates(program: str, env: dict[str, str]) -> list[bytes]:
    """Where to look for `program`, as execvp does: itself when it names a path, else in each
    directory of `env`'s PATH (the job's, not the launcher's) in turn."""
    if "/" in program:
        return [os.fsencode(program)]
    path = env.get("PATH", os.defpath).split(os.pathsep)
    return [os.fsencode(os.path.join(directory or ".", program)) for directory in path]


def sweep_shared(uid: int, swept: dict[tuple[int, str], int]) -> None:
    """Remove what `uid` left at the top of the machine's shared temporary directories (its own
    files, directories and links; a directory's whole tree, links in it unlinked, never
    followed): the next job of the uid is another user's. Its processes are killed by now (they
    run no more code).

    A directory whose modification time has not moved since its last sweep for `uid` gained no
    entry since, so it is not read again (`swept`: (uid, directory) -> that time). Only a time
    older than the sweep by more than the clock's granularity counts (MTIME_SLACK_NS): an entry
    made in the same tick as the last change would not move it."""
    for top in SHARED_TMP:
        try:
            before = os.stat(top).st_mtime_ns
            if swept.get((uid, top)) == before:
                continue
            now = time.time_ns()
            with os.scandir(top) as scan:
                entries = [e for e in scan if _owned_by(e, uid)]
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
    outlive their processes (the next job of the uid is another user's)."""
    for kind, (owner, creator) in SYSV_UID_COLUMNS.items():
        if sysv_count(kind) == 0:
            continue  # mostly: one system call, where reading the table takes ten times as long
        try:
            with open(f"/proc/sysvipc/{kind}") as table:
                rows = [line.split() for line in table.read().splitlines()[1:]]
        except OSError:
            continue
        for row in rows:
            if uid in (int(row[owner]), int(row[creator])):
                SYSV_REMOVE[kind](int(row[1]))


def sysv_count(kind: str) -> int:
    """How many System V objects of `kind` the machine has; -1 when it cannot tell."""
    command, field = SYSV_COUNTS[kind]
    info = ctypes.create_string_buffer(256)  # more than any of the three answers takes
    if command(info) < 0:
        return -1
    return int(struct.unpack_from("i", info, 4 * field)[0])


def _owned_by(entry: os.DirEntry[str], uid: int) -> bool:
    """Whether `entry` is `uid`'s; one that went meanwhile (another job's churn) is not."""
    try:
        return entry.stat(follow_symlinks=False).st_uid == uid
    except OSError:
        return False


class Launcher:
    """The launcher's loop: requests in, children started and reaped, replies out."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.selector = selectors.DefaultSelector()
        self.partial = b""
        self.running: dict[int, dict[str, Any]] = {}  # pids of jobs' first processes -> their request
        self.cgroup_files: dict[str, int] = {}  # path -> the directory, or the file open for writing
        self.devnull = os.open(os.devnull, os.O_RDONLY)  # every job's stdin
        self.swept: dict[tuple[int, str], int] = {}  # sweep_shared's memory
        self.killed: set[str] = set()  # cgroups whose cgroup.kill was written (cgroup_dir)
        # Ended jobs whose uid still has processes (killed, not yet reaped): pid -> (request,
        # status, when to stop waiting and tell what is stuck)
        self.dying: dict[int, tuple[dict[str, Any], int, float]] = {}

    def reply(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        data = json.dumps(message).encode()
        if fds:
            socket.send_fds(self.sock, [data], fds)
        else:
            self.sock.send(data)

    def run(self) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written
        self.selector.register(self.sock, selectors.EVENT_READ, "requests")
        self.selector.register(wake_r, selectors.EVENT_READ, "children")
        self.reap()  # a child that ended before the handler was set
        self.reply({"ready": os.getpid()})
        while True:
            for key, _ in self.selector.select(DYING_POLL if self.dying else None):
                if key.data == "requests":
                    if not self.read_requests():
                        self.kill_all()
                        return
                else:
                    os.read(wake_r, 4096)
                    self.reap()
            if self.dying:
                self.check_dying()

    def read_requests(self) -> bool:
        """Handle every datagram waiting; False at end of file (the worker has gone)."""
        while True:
            try:
                data = self.sock.recv(MAX_DATAGRAM + 1, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True
            if not data:
                return False
            if data[:1] == b"+":
                self.partial += data[1:]
                continue
            message, self.partial = json.loads(self.partial + data), b""
            try:
                if message["op"] == "spawn":
                    self.spawn(message)
                elif message["op"] == "sweep":
                    self.sweep(message)
            except Exception as exc:  # noqa: BLE001 - a request must never end the loop (every job)
                print(f"launcher: request {message.get('id')} failed: {exc!r}", file=sys.stderr)
                self.reply({"id": message.get("id"), "errno": errno.EINVAL})

    def spawn(self, request: dict[str, Any]) -> None:
        """Start the job's first process (_spawn.c), and tell its pid with its output pipe."""
        if request.get("uid") is not None:  # what another uid made and gave this one (IPC_SET)
            sweep_ipc(request["uid"])
        out_r, out_w = os.pipe()
        try:
            env = request["env"]
            uid, gid = request.get("uid", -1), request.get("gid", -1)  # -1: the launcher's
            cgroup = request.get("cgroup")
            pid = _spawn.spawn(
                candidates(request["argv"][0], env),
                [os.fsencode(arg) for arg in request["argv"]],
                [os.fsencode(f"{k}={v}") for k, v in env.items()],
                os.fsencode(request["cwd"]),
                self.devnull,
                out_w,
                uid,
                gid,
                *(self.cgroup_dir(cgroup) if cgroup else (-1, False)),
            )
        except (OSError, ValueError) as exc:  # ValueError: a NUL (the server refuses such specs)
            self.reply({"id": request["id"], "errno": getattr(exc, "errno", None) or errno.EINVAL})
            os.close(out_r)
            return
        finally:
            os.close(out_w)
        self.running[pid] = request
        try:
            self.reply({"id": request["id"], "pid": pid}, [out_r])
        finally:
            os.close(out_r)

    def sweep(self, request: dict[str, Any]) -> None:
        """What a slot's uid left behind a worker that died: its processes (until none is left,
        or DYING_SECONDS), then its temporary files and its System V IPC objects."""
        deadline = time.monotonic() + DYING_SECONDS
        while uid_left(request) and time.monotonic() < deadline:
            self.reap()  # ours, if the orphans of a launcher before us came to this one
            time.sleep(DYING_POLL)
        sweep_shared(request["uid"], self.swept)
        sweep_ipc(request["uid"])
        self.reply({"id": request["id"]})

    def cgroup_dir(self, cgroup: str) -> tuple[int, bool]:
        """`cgroup`'s directory, opened once (a slot's cgroup serves all its jobs), and whether a
        job may be born in it (_spawn.c). Not in one that was killed: Linux (6.18 at least) marks
        a cgroup on cgroup.kill and SIGKILLs every process born in it afterwards. Such a cgroup is
        made anew once empty (it has no settings to lose: cgroups.py enables no controller); until
        then the job joins it after birth."""
        if cgroup in self.killed and not cgroups.populated(Path(cgroup)):
            for name in (cgroup, os.path.join(cgroup, "cgroup.kill")):
                if (fd := self.cgroup_files.pop(name, None)) is not None:
                    os.close(fd)
            with contextlib.suppress(OSError):
                os.rmdir(cgroup)
                self.killed.discard(cgroup)
            os.makedirs(cgroup, exist_ok=True)
        fd = self.cgroup_files.get(cgroup)
        if fd is None:
            fd = self.cgroup_files[cgroup] = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
        return fd, cgroup not in self.killed

    def cgroup_file(self, cgroup: str, name: str) -> int:
        """`cgroup`'s file `name` (cgroup.kill), opened once for writing: a slot's
        cgroup serves all its jobs."""
        key = os.path.join(cgroup, name)
        fd = self.cgroup_files.get(key)
        if fd is None:
            fd = self.cgroup_files[key] = os.open(key, os.O_WRONLY)
        return fd

    def kill_all(self) -> None:
        """The worker has gone: so do the jobs it started."""
        for pid in self.running:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.running:
                self.ended(pid, self.running.pop(pid), os.waitstatus_to_exitcode(status))

    def ended(self, pid: int, request: dict[str, Any], code: int) -> None:
        """A job's first process has ended: the attempt has. All it started is killed before
        that is told: with a cgroup in one write (and what is still in it, dying, told too, for
        the worker to wait for); else, with a uid, as that uid (_spawn.c), and told once no
        process of the uid is left (this process is their subreaper: every orphan of a job is
        its child, reaped here), or what is stuck after DYING_SECONDS."""
        left: list[int] = []
        if cgroup := request.get("cgroup"):
            # Only a cgroup where something of the job is left: an empty one gains nothing (only
            # what is in it could fork into it), and a killed one must be made anew (cgroup_dir).
            if cgroups.populated(Path(cgroup)):
                with contextlib.suppress(OSError):
                    os.write(self.cgroup_file(cgroup, "cgroup.kill"), b"1")
                self.killed.add(cgroup)
                with contextlib.suppress(OSError):
                    left = cgroups.pids(Path(cgroup))  # killed, not yet gone
        elif request.get("uid") is not None and uid_left(request):
            self.dying[pid] = (request, code, time.monotonic() + DYING_SECONDS)
            return
        self.finish(pid, request, code, left)

    def check_dying(self) -> None:
        for pid, (request, code, deadline) in list(self.dying.items()):
            if not uid_left(request):
                del self.dying[pid]
                self.finish(pid, request, code, [])
            elif time.monotonic() > deadline:
                del self.dying[pid]
                self.finish(pid, request, code, processes_of(request["uid"]))

    def finish(self, pid: int, request: dict[str, Any], code: int, left: list[int]) -> None:
        if request.get("uid") is not None:
            sweep_shared(request["uid"], self.swept)
            sweep_ipc(request["uid"])
        self.reply({"exited": pid, "status": code, "left": left})


def uid_left(request: dict[str, Any]) -> bool:
    """SIGKILL every process of the request's uid; whether any is still there."""
    try:
        return _spawn.kill_uid(request["uid"], request["gid"])
    except OSError:  # it could not tell: /proc can
        return bool(processes_of(request["uid"]))


def processes_of(uid: int) -> list[int]:
    """The pids of `uid`'s processes, from /proc (for the rare one that does not die)."""
    pids = []
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError):
            if os.stat(f"/proc/{name}").st_uid == uid:
                pids.append(int(name))
    return pids


def main() -> None:
    fd = int(sys.argv[1])
    os.closerange(3, fd)  # what a loop that does not close on spawn (uvloop) left it
    os.closerange(fd + 1, MAX_FD)
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)  # passed to it inheritable: no job may hold it
    signal.pthread_sigmask(signal.SIG_SETMASK, [])  # uvloop starts it with every signal blocked
    for sig in IGNORED:  # the worker's to handle: this leaves when it has left
        signal.signal(sig, signal.SIG_IGN)
    # Every orphan of a job becomes this process's child, reaped here: a uid's end is known.
    LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    if sys.argv[2] == "1":
        harden()
    Launcher(sock).run()


if __name__ == "__main__":
    main()
