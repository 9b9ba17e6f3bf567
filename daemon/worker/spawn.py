"""Jobs' first processes, started from the worker's own event loop and watched there.

_spawn.c makes the process: the child shares the worker's memory until its exec (nothing is
copied, however large the worker), switches to its slot's uid, and execs, without the loop
waiting for it (x86-64). The kernel hands back a pidfd, which the loop watches: it becomes
readable when the process has ended, and one waitid collects it. Start to end, a job costs the
worker two system calls beyond its own (clone3 and waitid) and no message to another process:
a helper that started jobs for the worker cost each job four, and the wakeups they caused were
most of what a short job cost.

Before `Child.wait()` says a job's first process has ended, nothing the job started may go on:
- with its slot's cgroup (cgroups.py), one write to the cgroup's cgroup.kill ends all of it;
- else, with a uid of its own, every process of the uid is killed as that uid (uid_sweep.py), until
  none is alive, DYING_SECONDS at most;
- with a uid, what it left in the shared temporary directories and its System V IPC objects go too.
Without either (a single user's worker), what is left is the runner's to find (leftovers.py).

A job with a uid of its own is also confined before its exec (confine.py): only its GPUs' device
nodes open, IPC (and with job_network = "private", network) namespaces of its own, fresh keyrings.
A command run inside a running job (spawn_in_job) joins that job's network and IPC namespaces
instead, and leaves its uid's keyrings and IPC objects as the job has them.

A job's processes outliving a killed worker are orphan_guard.py's to kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from daemon.aio import TaskSet
from daemon.worker import leftovers, uid_sweep
from daemon.worker.cgroups import SlotCgroup
from daemon.worker.confine import NOTHING, Confinement
from daemon.worker.identity import IdentityError, SlotIdentity
from daemon.worker.native import _spawn

log = logging.getLogger(__name__)

DYING_POLL = 0.01  # how often to look again for a killed uid's processes, while some are alive
DYING_SECONDS = 5.0  # how long to wait for them before telling the end with what is stuck
FS_ENCODING = sys.getfilesystemencoding()  # what os.fsencode encodes with (surrogateescape)
SWEEPER_SECONDS = 0.1  # how long a uid's sweeper may take before it is taken as stopped, and killed


class Child:
    """A started job's first process: `pid`, its merged stdout+stderr as the read end `output` (the
    caller's to read and close), `await wait()` for its status once all it started is gone.
    `start_error` tells, once it has ended, why it never ran its program (None: it did)."""

    def __init__(self, pid: int, output: int, errors: int = -1) -> None:
        self.pid = pid
        self.output = output
        self.errors = errors  # an exec's stderr, apart from its stdout (-1: merged into `output`)
        self.start_error: OSError | None = None
        self.start_step: str | None = None  # what it was doing then (None: looking for its program)
        # Reaped: its pid may be another process's now, and its job is ending (or has ended). Set
        # before its job's end is made, so nothing is started into the job from then on.
        self.reaped = False
        self._namespaces: dict[str, int] = {}  # "net", "ipc": its namespaces, once asked for
        self._ended: asyncio.Future[tuple[int, list[int]]] = asyncio.get_running_loop().create_future()

    @property
    def returncode(self) -> int | None:
        """The exit status once it has ended, else None."""
        return self._ended.result()[0] if self._ended.done() else None

    @property
    def left(self) -> list[int]:
        """Once it has ended: what was still dying in its cgroup when it was killed (the caller
        waits for them). Empty without a cgroup."""
        return self._ended.result()[1] if self._ended.done() else []

    async def wait(self) -> int:
        """The exit status (-N: killed by signal N). Cancelling the wait leaves the watch in place."""
        status, _ = await asyncio.shield(self._ended)
        return status

    def namespace(self, kind: str) -> int:
        """A new descriptor (the caller's to close) of its namespace `kind` ("net", "ipc"), as its
        program sees it. Opened once, while it is unreaped and so its pid still its own, and held
        until its end: never /proc/PID of a pid reaped and maybe reused. Raises
        ProcessLookupError once reaped."""
        if kind not in self._namespaces:
            if self.reaped:
                raise ProcessLookupError(errno.ESRCH, "the job's first process has ended")
            self._namespaces[kind] = os.open(f"/proc/{self.pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
        return os.dup(self._namespaces[kind])

    def ended(self, status: int, left: list[int]) -> None:
        _close(*self._namespaces.values())
        self._namespaces.clear()
        if not self._ended.done():
            self._ended.set_result((status, left))


class Spawner:
    """Starts the worker's jobs, watches them, and ends what each left. `close()` at the end,
    once every job has ended."""

    def __init__(self, job_nice: int = 0, confinement: Confinement | None = None) -> None:
        """`job_nice`: how much nicer than this process its jobs run (their niceness, which they
        may raise but never lower again). `confinement`: what jobs with a uid of their own give
        up (confine.py; default: what a worker on the host network does)."""
        self.nice = min(os.getpriority(os.PRIO_PROCESS, 0) + job_nice, 19) if job_nice else None
        self.confinement = confinement or Confinement()
        self._devnull = os.open(os.devnull, os.O_RDONLY)  # every job's stdin
        self._swept: uid_sweep.Swept = {}  # uid_sweep.sweep_shared's memory
        self._ends = TaskSet("ending job %s failed; its end is taken as now")  # ends that must wait

    def spawn(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[str, str],
        identity: SlotIdentity | None = None,
        cgroup: SlotCgroup | None = None,
        gpus: Collection[int] | None = None,
        terminal: int | None = None,
        joins: tuple[int, ...] = (),
    ) -> Child:
        """Start `argv` (no shell) in `cwd` with exactly `env` (PATH looked up in it), stdin from
        /dev/null, stdout and stderr into one pipe (with `terminal`, the slave end of a PTY, the
        caller's to close: its stdin, stdout and stderr all that terminal, made the controlling
        terminal of its session; `Child.output` is -1 then), in a session of its own, as `identity` when
        given (its directory entered as that uid), born in `cgroup` when given. With `identity`,
        it is confined (confine.py) to the GPUs whose minor numbers are `gpus` (None: unknown,
        every GPU's node is left as it is). Returns at once; a program that could not start (no
        such program, no such directory, one the uid may not enter, a namespace the kernel
        refused) ends at once with `start_error` set. Raises OSError when no process could be
        made. `joins`: more cgroup directories (open, cgroup v1's: slot_limits.py) it joins before
        it runs anything of the job's."""
        return self._spawn(
            argv, cwd, env, identity, cgroup, gpus, stdin=None, in_job=None, terminal=terminal, joins=joins
        )

    def spawn_in_job(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[str, str],
        identity: SlotIdentity | None,
        cgroup: SlotCgroup | None,
        gpus: Collection[int] | None,
        stdin: int | None,
        job: Child,
    ) -> Child:
        """A command run inside a running job (`poolctl exec`, execs.py), as `spawn` starts the
        job's first process, but: stdin from `stdin` (a read end, the caller's to close; None:
        /dev/null), stderr into a pipe of its own (`Child.errors`), in the network and IPC
        namespaces of `job` (its first process: unreaped, or ProcessLookupError), its uid's
        keyrings and IPC objects left as the job has them, and its end ends nothing else: its
        uid and cgroup are its job's, whose end ends them (its caller kills its process group)."""
        joined = (job.namespace("net"), job.namespace("ipc")) if identity is not None else (-1, -1)
        try:
            return self._spawn(argv, cwd, env, identity, cgroup, gpus, stdin=stdin, in_job=joined)
        finally:
            _close(*joined)

    def _spawn(  # noqa: PLR0917 - spawn's and spawn_in_job's arguments, passed on as they came
        self,
        argv: Sequence[str],
        cwd: Path,
        env: Mapping[str, str],
        identity: SlotIdentity | None,
        cgroup: SlotCgroup | None,
        gpus: Collection[int] | None,
        *,
        stdin: int | None,
        in_job: tuple[int, int] | None,  # an exec's: its job's network and IPC namespaces (or -1)
        terminal: int | None = None,  # a tty job's: its terminal's slave end
        joins: tuple[int, ...] = (),
    ) -> Child:
        plan = NOTHING
        if identity is not None:
            if not in_job:  # an exec's IPC objects are its running job's
                uid_sweep.sweep_ipc(identity.uid)  # what another uid made and gave this one (IPC_SET)
            plan = self.confinement.plan(gpus)
        read, write = os.pipe() if terminal is None else (-1, -1)
        errors_read, errors_write = os.pipe() if in_job else (-1, -1)
        if terminal is not None:
            stdin = terminal
        try:
            place, born_in = cgroup.birthplace() if cgroup is not None else (-1, False)
            pid, pidfd = _spawn.spawn(
                candidates(argv[0], env.get("PATH", os.defpath)),
                [os.fsencode(arg) for arg in argv],
                [f"{k}={v}".encode(FS_ENCODING, "surrogateescape") for k, v in env.items()],
                os.fsencode(cwd),
                self._devnull if stdin is None else stdin,
                write if terminal is None else terminal,
                identity.uid if identity is not None else -1,
                identity.gid if identity is not None else -1,
                place,
                born_in,
                -100 if self.nice is None else self.nice,
                plan.hidden,
                plan.own_ipc and not in_job,  # an exec joins its job's instead
                plan.own_net and not in_job,
                *((errors_write, *in_job) if in_job else (-1, -1, -1)),  # a job's own: one pipe
                terminal is not None,
                joins,
            )
        except ValueError as exc:  # a NUL byte (the server refuses such specs): no exec could take it
            _close(read, errors_read)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL)) from exc
        except BaseException:
            _close(read, errors_read)
            raise
        finally:
            _close(write, errors_write)
        child = Child(pid, read, errors_read)
        # An exec in a job ends nothing at its end: its job's end does (below, for the job's own).
        ends = (None, None) if in_job else (identity, cgroup)
        if pidfd >= 0:
            loop = asyncio.get_running_loop()
            loop.add_reader(pidfd, self._exited, child, pidfd, *ends)
        else:  # a kernel without pidfds (before 5.2): a thread waits, as asyncio's own watcher does
            threading.Thread(target=self._wait_in_thread, args=(child, *ends), daemon=True).start()
        return child

    def _exited(
        self, child: Child, pidfd: int, identity: SlotIdentity | None, cgroup: SlotCgroup | None
    ) -> None:
        got = _spawn.reap(child.pid, pidfd)
        if got is None:
            return  # not yet (a spurious wakeup)
        child.reaped = True
        asyncio.get_running_loop().remove_reader(pidfd)
        os.close(pidfd)
        self._end(child, got, identity, cgroup)

    def _wait_in_thread(self, child: Child, identity: SlotIdentity | None, cgroup: SlotCgroup | None) -> None:
        got = _spawn.reap(child.pid, -1, True)
        assert got is not None
        child.reaped = True  # (the loop's spawns check it: at worst one races it, and _end kills it)
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            child._ended.get_loop().call_soon_threadsafe(self._end, child, got, identity, cgroup)

    def _end(
        self,
        child: Child,
        reaped: tuple[int, int, str | None],
        identity: SlotIdentity | None,
        cgroup: SlotCgroup | None,
    ) -> None:
        """The first process has ended (`reaped`: what _spawn.reap said): end what it left (see
        the module doc), then say so."""
        status, error, step = reaped
        if error:
            why = os.strerror(error) if step is None else f"{os.strerror(error)} ({step})"
            child.start_error, child.start_step = OSError(error, why), step
        left = cgroup.end() if cgroup is not None else []
        if identity is None:
            child.ended(status, left)
        elif cgroup is not None and not uid_sweep.shared_changed(identity.uid, self._swept):
            uid_sweep.sweep_ipc(identity.uid)  # the common end: nothing waits
            child.ended(status, left)
        else:
            self._ends.spawn(
                self._end_uid(child, status, identity, left, kill=cgroup is None), str(child.pid)
            )

    async def _end_uid(
        self, child: Child, status: int, identity: SlotIdentity, left: list[int], *, kill: bool
    ) -> None:
        try:
            if kill:
                left = await self.kill_uid(identity)
            await self._sweep_files(identity)
        finally:
            child.ended(status, left)

    async def check(self, identity: SlotIdentity) -> None:
        """Raise IdentityError, saying why, if a job of `identity` cannot be confined here (a
        worker without CAP_SYS_ADMIN, a kernel or seccomp filter refusing a namespace): better a
        worker that does not start than one that fails every job it takes. Its test job's
        program cannot exec (/dev/null): every step before the exec is taken, nothing runs."""
        child = self.spawn([os.devnull], cwd=Path("/"), env={}, identity=identity, gpus=())
        os.close(child.output)
        await child.wait()
        if child.start_step is not None and child.start_error is not None:
            raise IdentityError(
                f"this worker cannot confine its jobs: {child.start_error.strerror}; as root, it "
                "needs CAP_SYS_ADMIN and mount, IPC and network namespaces (systemd/pool-worker.service: "
                "CapabilityBoundingSet, RestrictNamespaces)"
            )

    async def sweep(self, identity: SlotIdentity) -> None:
        """Kill every process of `identity`'s uid and remove its temporary files and IPC objects
        (a worker's start: its slots' uids may hold what a worker that died left)."""
        await self.kill_uid(identity)
        await self._sweep_files(identity)

    async def _sweep_files(self, identity: SlotIdentity) -> None:
        if uid_sweep.shared_changed(identity.uid, self._swept):
            await asyncio.to_thread(uid_sweep.sweep_shared, identity.uid, self._swept)
        uid_sweep.sweep_ipc(identity.uid)

    async def kill_uid(self, identity: SlotIdentity) -> list[int]:
        """SIGKILL every process of the uid, as the uid, until none is alive: [] then, or what is
        still alive after DYING_SECONDS (stuck, say in a dead filesystem)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DYING_SECONDS
        while True:
            await self._sweeper(identity)
            left = uid_sweep.alive(identity.uid)
            if not left or loop.time() > deadline:
                return left
            await asyncio.sleep(DYING_POLL)

    async def _sweeper(self, identity: SlotIdentity) -> None:
        """One sweep of the uid (_spawn.sweep), waited for SWEEPER_SECONDS at most: a process of
        the uid may have stopped it (SIGSTOP), and then it is killed."""
        pid, pidfd = _spawn.sweep(identity.uid, identity.gid)
        if pidfd < 0:
            got = await asyncio.to_thread(_spawn.reap, pid, -1, True)
        else:
            ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().add_reader(pidfd, leftovers.exited, ready)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ready, SWEEPER_SECONDS)
            finally:
                asyncio.get_running_loop().remove_reader(pidfd)
            got = _spawn.reap(pid, pidfd)
            if got is None:  # stopped: killed, and waited for in a thread (the loop made the pidfd
                # non-blocking, which waitid would answer with EAGAIN)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                os.set_blocking(pidfd, True)
                got = await asyncio.to_thread(_spawn.reap, pid, pidfd, True)
            os.close(pidfd)
        if got is not None and got[0] == 2:
            raise OSError(f"cannot switch to uid {identity.uid} to end its processes")

    async def close(self) -> None:
        """Wait for the ends still being made (every job has ended by now). Safe twice."""
        await self._ends.stop()
        if self._devnull >= 0:
            os.close(self._devnull)
            self._devnull = -1


def _close(*fds: int) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)


@functools.lru_cache(maxsize=256)  # a worker runs the same few programs with the same PATH
def candidates(program: str, path: str) -> tuple[bytes, ...]:
    """Where to look for `program`, as execvp does: itself when it names a path, else in each
    directory of `path` (the job's PATH, not the worker's) in turn."""
    if "/" in program:
        return (os.fsencode(program),)
    return tuple(os.fsencode(os.path.join(directory or ".", program)) for directory in path.split(os.pathsep))
