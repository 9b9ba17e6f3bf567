"""The launcher: a small process of the worker's that starts its jobs, reaps them, and kills a slot's
uid, so that the worker's event loop never forks, execs or waits (spawn.py is the worker's side).

It is a program of its own, run as `python -I -S launcher.py FD HARDEN` with the standard library
only, so its fork is cheap (a few MB of page tables, not the worker's hundreds) and nothing of the
worker's environment or sys.path reaches it. It speaks over one SOCK_SEQPACKET socket, FD, one
JSON message per datagram (requests may come in several: a first byte "+" says more follow):

    (first, once it is ready)  -> {"ready": PID}
    {"op": "spawn", "id": N, "argv": [...], "env": {...}, "cwd": "...", "uid": U, "gid": G}
        -> {"id": N, "pid": P} with the read end of the job's output pipe attached (SCM_RIGHTS),
           sent once the exec has happened; or {"id": N, "errno": E} when it could not start.
        -> later {"exited": P, "status": S} (S as subprocess gives it: -N for signal N), once
           what the job started has been sent SIGKILL (the attempt has ended: nothing of it may
           go on, setsid and `env -i` escapes included), without a round trip to the worker:
           given a cgroup ("cgroup": DIR, cgroups.py, which the child joins before anything
           else) by one write to its cgroup.kill; else, given a uid, by a child running as it.

A job's child, between fork and exec: a session of its own (its group is its pid, so one killpg
reaches what it starts), stdin from /dev/null, stdout and stderr into one pipe, the signal
dispositions a program expects, then, given a uid, no supplementary groups, the gid and uid (all
three of each: nothing can switch back), and only then the chdir, as the uid, into `cwd`, and
exec with exactly `env` (PATH looked up in it). With HARDEN=1 (a worker with slot uids) the
launcher first gives up for good, for itself and so for every job, the right to gain privileges on
exec (no_new_privs: setuid programs and file capabilities grant nothing), its bounding,
inheritable and ambient capabilities: a job, once its uid is not root, holds no capability and can
gain none. The launcher keeps its effective ones, which switching uids and killing need.

Its end of the socket is close-on-exec, so no job holds it. It leaves when the worker has left
(end of file on the socket), never on a signal meant for the worker, and kills the groups of the
jobs it started first (what left them is the orphan guard's, orphan_guard.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import selectors
import signal
import socket
import sys
from typing import Any

MAX_FD = 2**31 - 1
MAX_DATAGRAM = 32 * 1024  # requests are cut into datagrams of this many bytes
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
# Signals the launcher must survive: it catches them, with a handler that does nothing, rather than
# ignore them, because an exec resets a caught signal to its default and keeps an ignored one
# ignored: a job then starts with every disposition a program expects, and its child spends
# nothing on resetting them (a Python signal.signal per signal cost a quarter of a job's start).
SURVIVED = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)


def harden() -> None:
    """No privileges to gain on exec and no capabilities to pass on, for good (see above)."""
    import ctypes  # noqa: PLC0415 - only a hardened launcher needs it

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # EINVAL past the last capability
        cap += 1
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL before Linux 4.3: none
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # two of {effective, permitted, inheritable}
    if libc.capget(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    data[2] = data[5] = 0
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def exec_job(request: dict[str, Any], out: int, err: int) -> None:
    """In the forked child: become the job (see above). Never returns; on failure the errno goes
    to `err` (close-on-exec: an exec that happens closes it empty)."""
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        err = os.dup2(err, 3, inheritable=False)
        os.closerange(4, MAX_FD)  # close_range(2): whatever the launcher holds, the job does not
        if cgroup := request.get("cgroup"):  # as root, before the switch: the job cannot leave it
            procs = os.open(os.path.join(cgroup, "cgroup.procs"), os.O_WRONLY)
            os.write(procs, b"0")
            os.close(procs)
        uid, gid = request.get("uid"), request.get("gid")
        if uid is not None and gid is not None:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        os.chdir(request["cwd"])
        execute(request["argv"], request["env"])
    except OSError as exc:
        os.write(err, str(exc.errno or 0).encode())
    except BaseException:  # noqa: BLE001 - a child must never return into the launcher's loop
        os.write(err, b"0")
    finally:
        os._exit(127)


def execute(argv: list[str], env: dict[str, str]) -> None:
    """exec `argv`, looking its program up in `env`'s PATH as execvp does. (os.execvpe does the
    same in Python that imports `warnings` on each call: in a fresh child, that import alone
    doubled the cost of starting a job.)"""
    program = argv[0]
    if "/" in program:
        os.execve(program, argv, env)  # noqa: S606 - argv, no shell
    failure: OSError | None = None
    for directory in env.get("PATH", os.defpath).split(os.pathsep):
        try:
            os.execve(os.path.join(directory or ".", program), argv, env)  # noqa: S606
        except (FileNotFoundError, NotADirectoryError) as exc:
            failure = failure or exc
        except OSError as exc:  # EACCES and the like: say that one, as execvp does
            failure = exc
    raise failure or FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)


def kill_uid(uid: int, gid: int) -> None:
    """In the forked child: as `uid`, SIGKILL every process of it. kill(-1) reaches them all in one
    pass of the kernel's task list, and a process with SIGKILL pending cannot finish a fork, so no
    fork loop outruns it; a second pass costs nothing."""
    try:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        for _ in range(2):
            os.kill(-1, signal.SIGKILL)
    except BaseException:  # noqa: BLE001, S110 - nothing left of the uid to kill; say nothing
        pass
    finally:
        os._exit(0)


class Launcher:
    """The launcher's loop: requests in, children started and reaped, replies out."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.selector = selectors.DefaultSelector()
        self.partial = b""
        self.starting: dict[int, tuple[dict[str, Any], int, int]] = {}  # pid -> (request, output, error pipe)
        self.running: dict[int, dict[str, Any]] = {}  # pids whose start was told -> their request
        self.kill_files: dict[str, int] = {}  # slot cgroup -> its cgroup.kill, open for writing
        self.sweeps: dict[int, tuple[int, int]] = {}  # pid of a kill_uid child -> (job pid, status)

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
            for key, _ in self.selector.select():
                if key.data == "requests":
                    if not self.read_requests():
                        self.kill_all()
                        return
                elif key.data == "children":
                    os.read(wake_r, 4096)
                    self.reap()
                else:
                    self.started(key.data)

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
            if message["op"] == "spawn":
                self.spawn(message)

    def spawn(self, request: dict[str, Any]) -> None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            exec_job(request, out_w, err_w)
        os.close(out_w)
        os.close(err_w)
        self.starting[pid] = (request, out_r, err_r)
        self.selector.register(err_r, selectors.EVENT_READ, pid)

    def started(self, pid: int) -> None:
        """The child's error pipe is readable: it has exec'd (end of file) or failed (an errno)."""
        if pid not in self.starting:
            return  # told already: it ended, and was reaped, in the same turn of the loop
        request, out_r, err_r = self.starting.pop(pid)
        self.selector.unregister(err_r)
        failure = os.read(err_r, 64)
        os.close(err_r)
        try:
            if failure:
                self.reply({"id": request["id"], "errno": int(failure)})
            else:
                self.reply({"id": request["id"], "pid": pid}, [out_r])
                self.running[pid] = request
        finally:
            os.close(out_r)

    def kill_file(self, cgroup: str) -> int:
        """`cgroup`'s cgroup.kill, opened once (a slot's cgroup serves all its jobs)."""
        fd = self.kill_files.get(cgroup)
        if fd is None:
            fd = self.kill_files[cgroup] = os.open(os.path.join(cgroup, "cgroup.kill"), os.O_WRONLY)
        return fd

    def kill_all(self) -> None:
        """The worker has gone: so do the jobs it started, told or not."""
        for pid in [*self.starting, *self.running]:
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
            if pid in self.starting:  # ended before its start was told: tell that first
                self.started(pid)
            if pid in self.sweeps:
                job, code = self.sweeps.pop(pid)
                self.reply({"exited": job, "status": code})
            elif pid in self.running:
                self.ended(pid, self.running.pop(pid), os.waitstatus_to_exitcode(status))

    def ended(self, pid: int, request: dict[str, Any], code: int) -> None:
        """A job's first process has ended: the attempt has. With a cgroup, all it started is
        killed in one write; else, with a uid, by a child running as that uid (told once reaped)."""
        if cgroup := request.get("cgroup"):
            with contextlib.suppress(OSError):
                os.write(self.kill_file(cgroup), b"1")
        elif request.get("uid") is not None:
            sweeper = os.fork()
            if sweeper == 0:
                kill_uid(request["uid"], request["gid"])
            self.sweeps[sweeper] = (pid, code)
            return
        self.reply({"exited": pid, "status": code})


def main() -> None:
    fd = int(sys.argv[1])
    os.closerange(3, fd)  # what a loop that does not close on spawn (uvloop) left it
    os.closerange(fd + 1, MAX_FD)
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)  # passed to it inheritable: no job may hold it
    signal.pthread_sigmask(signal.SIG_SETMASK, [])  # uvloop starts it with every signal blocked
    for sig in signal.valid_signals():  # and what the worker was given ignored, its jobs are not
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
    for sig in SURVIVED:  # SIGINT, SIGTERM: the worker's to handle; this leaves when it has left
        signal.signal(sig, lambda *_: None)
    if sys.argv[2] == "1":
        harden()
    Launcher(sock).run()


if __name__ == "__main__":
    main()
