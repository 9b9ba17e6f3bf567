"""The orphan guard: a tiny helper process that kills a worker's jobs when the worker cannot.

It covers two cases the worker itself cannot.

The worker dies. A job's processes would otherwise outlive a killed worker as orphans (a shell's
background children, a training script's data-loader processes), holding GPUs no one will ever
hand out. When the guard's stdin reaches end of file, because the worker exited and the kernel
closed its end of the pipe (SIGKILL included), the guard SIGKILLs every group still listed, then
every process whose environment carries this worker's `GPUPOOL_WORKER=ID` (run_types.job_env sets
it) or that runs as one of its slots' uids (identity.py): that covers a job the worker started but
died before announcing, descendants that moved to a group of their own, and, for slots with a uid
of their own, whatever cleared its environment too. Then it exits. (A kernel death signal,
PR_SET_PDEATHSIG, would need a preexec_fn and so a full fork of the worker per job: see spawn.py.)

The worker is frozen (SIGSTOP, a debugger, a VM paused under it). Its leases then expire in Redis
and its jobs start elsewhere, while the frozen worker's processes would run on beside them. So the
guard holds, for each lease, the deadline the worker last knew it good until (attempt.py: by
CLOCK_BOOTTIME, which counts suspended time too), and SIGKILLs the lease's process group, its
session, and every process carrying the lease's mark (`GPUPOOL_ATTEMPT_ID=LEASE`: a job started by
a worker frozen before it announced the group) once that deadline passes; the worker kills at the
same moment when it is alive to. The worker writes each line as it says it, so a worker frozen
at any moment has told the guard all it said: the deadline before the job starts, the group
just after. While it
guards anything, the guard looks every CHECK_SECONDS (its sleeps run on the monotonic clock, which
stops while the machine is suspended) and reads what the worker said meanwhile in one go: it is
not woken for each line, which costs a busy worker a context switch per line on a small machine.
With nothing to guard it sleeps until the worker says something.

The worker speaks in lines on the guard's stdin: `+PGID LEASE` (watch a job's group, run under
LEASE), `-PGID` (its processes are gone), `d LEASE DEADLINE` (the lease holds until DEADLINE,
seconds of CLOCK_BOOTTIME), `x LEASE` (the attempt has ended). The guard runs in its own session,
so a Ctrl-C or a SIGTERM meant for the worker does not stop it first, and a SIGSTOP of the worker
does not freeze it: it leaves when the worker has left, never before. It has no death signal of its
own for the same reason. The pipe is close-on-exec in the worker, so no job inherits it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from daemon.helper_env import helper_env

log = logging.getLogger(__name__)

CHECK_SECONDS = 0.2  # the guard looks at its pipe and its deadlines this often

GUARD_SOURCE = r"""
import os, select, signal, sys, time
mark, poll = sys.argv[1].encode(), float(sys.argv[2])
uids = {int(u) for u in sys.argv[3].split(",") if u}
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
groups, deadlines, buf = {}, {}, b""

def kill_group(group):
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
    for name in os.listdir("/proc"):  # what left the group but not the session
        try:
            if name.isdigit() and os.getsid(int(name)) == group:
                os.kill(int(name), signal.SIGKILL)
        except OSError:
            pass

def environ(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read().split(b"\0")

def kill_lease(lease):  # what carries the lease's mark: started, the worker frozen before telling
    attempt = b"GPUPOOL_ATTEMPT_ID=" + lease
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and int(name) != os.getpid():
                env = environ(name)
                if mark in env and attempt in env:
                    os.kill(int(name), signal.SIGKILL)
        except OSError:
            pass

while True:
    now = time.clock_gettime(time.CLOCK_BOOTTIME)
    for lease, deadline in list(deadlines.items()):
        if deadline <= now:
            for group in [g for g, held in groups.items() if held == lease]:
                kill_group(group)
                del groups[group]
            kill_lease(lease)
            del deadlines[lease]  # a worker that wakes and still holds it says so again
    if not groups and not deadlines:
        select.select([0], [], [])  # nothing to guard: asleep until the worker says something
    else:
        # A look every `poll` at most: the worker's lines are not worth a wakeup each (four a
        # job), and a dead worker's end of file or a deadline waits no longer than this.
        time.sleep(min(poll, max(0.0, min(deadlines.values()) - now)) if deadlines else poll)
    data, ended = b"", False
    while select.select([0], [], [], 0)[0]:
        chunk = os.read(0, 65536)
        if not chunk:
            ended = True
            break
        data += chunk
    if ended and not data:
        break
    *lines, buf = (buf + data).split(b"\n")
    for line in lines:
        word = line.split()
        if line[:1] == b"+":
            groups[int(word[0][1:])] = word[1] if len(word) > 1 else b""
        elif line[:1] == b"-":
            groups.pop(int(line[1:]), None)
        elif line[:1] == b"d":
            deadlines[word[1]] = float(word[2])
        elif line[:1] == b"x":
            deadlines.pop(word[1], None)
    if ended:
        break
for group in groups:
    kill_group(group)
for uid in uids:  # as the uid: kill(-1) reaches all of them at once, a fork loop included
    child = os.fork()
    if child == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            for _ in range(2):  # one pass reaches all; a fork racing it fails
                os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        os._exit(0)
    os.waitpid(child, 0)
for _ in range(3):  # again, for any that forked while the last pass ran
    marked = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid not in uids and mark not in environ(name):
                continue
            os.kill(int(name), signal.SIGKILL)
            marked += 1
        except OSError:
            pass
    if not marked:
        break
"""


class OrphanGuard:
    """The worker's side of the guard. `start()` once and `watch_over()` in a task of its own;
    `hold`/`drop` per lease, `watch`/`forget` per job's process group; `stop()` at the end.
    `mark` is the environment entry every job of this worker carries (`GPUPOOL_WORKER=ID`); `uids`
    are its slots' own (identity.py), whose every process is a job's.

    It keeps what it told the guard (the groups and deadlines it holds), so that a guard that
    died (killed by hand, the OOM killer) is started again by `watch_over` and told it all anew."""

    def __init__(self, mark: str, uids: Sequence[int] = ()) -> None:
        self.mark = mark
        self.uids = tuple(uids)
        self._proc: asyncio.subprocess.Process | None = None
        self._groups: dict[int, str] = {}  # pgid -> lease
        self._deadlines: dict[str, float] = {}  # lease -> deadline
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-c",
            GUARD_SOURCE,
            self.mark,
            str(CHECK_SECONDS),
            ",".join(map(str, self.uids)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            env=helper_env(),  # it is dumpable, and of the worker's uid: none of the worker's secrets
        )

    async def watch_over(self) -> None:
        """Until cancelled: when the guard process ends before `stop()`, start a new one and tell
        it every group and deadline held; a worker without its guard would leave its jobs behind
        if it died, and a frozen one would not have them stopped."""
        while (proc := self._proc) is not None:
            await proc.wait()
            if self._stopping or self._proc is not proc:
                return
            log.critical(
                "the orphan guard (pid %d) ended with status %s; starting a new one",
                proc.pid,
                proc.returncode,
            )
            await self.start()
            for lease, deadline in self._deadlines.items():
                self._send(f"d {lease} {deadline:.3f}\n")
            for pgid, lease in self._groups.items():
                self._send(f"+{pgid} {lease}\n")

    def watch(self, pgid: int, lease: str = "") -> None:
        """Kill process group `pgid` if the worker dies before `forget(pgid)`, or once the deadline
        of `lease` (see `hold`) passes."""
        self._groups[pgid] = lease
        self._send(f"+{pgid} {lease}\n")

    def forget(self, pgid: int) -> None:
        """The group's processes are gone: the id may be reused by someone else's group."""
        self._groups.pop(pgid, None)
        self._send(f"-{pgid}\n")

    def hold(self, lease: str, deadline: float) -> None:
        """`lease` holds until `deadline` (CLOCK_BOOTTIME seconds); its group dies then."""
        self._deadlines[lease] = deadline
        self._send(f"d {lease} {deadline:.3f}\n")

    def drop(self, lease: str) -> None:
        """The attempt of `lease` has ended: no deadline to keep for it."""
        self._deadlines.pop(lease, None)
        self._send(f"x {lease}\n")

    def _send(self, line: str) -> None:
        """Write `line` now: a worker may be frozen the moment this returns, and what it said
        must be the guard's by then. A few bytes into a pipe the guard keeps reading: the write
        is done at once (no drain(), so callers stay synchronous), and it does not wake a guard
        that guards anything (it looks every CHECK_SECONDS)."""
        proc = self._proc
        if proc is None or proc.stdin is None or proc.returncode is not None or proc.stdin.is_closing():
            return  # gone: watch_over starts a new one and tells it everything
        proc.stdin.write(line.encode())

    async def stop(self) -> None:
        """Close the guard's stdin (it kills any group still listed) and wait for it. Safe twice."""
        self._stopping = True
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()
        await proc.wait()
