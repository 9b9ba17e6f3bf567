"""A cgroup per slot, where the kernel allows: every process a job starts is in it, wherever it
went (its own session, `env -i`, a fork loop), and one write to `cgroup.kill` ends them all.

Linux's cgroup v2 keeps a process in its parent's cgroup on fork, and an unprivileged process
cannot move out (it may not write another cgroup's `cgroup.procs`), so the slot's cgroup holds
exactly what its job started. `cgroup.kill` (Linux >= 5.14) SIGKILLs every process in it in one
call, racing forks included; `cgroup.procs` lists what is still there. That replaces, where it is
available, a scan over /proc at the end of each attempt and a fork to kill the slot's uid as that
uid (leftovers.py, uid_sweep.py): one write against a scan and a fork.

The worker needs root (or a delegated subtree) and a cgroup v2 hierarchy: the shipped unit says
`Delegate=yes`. Its cgroups are `gpupool-WORKER/slot-N` under its own cgroup, created at start and
removed at the end; no controller is enabled, so nothing changes for the worker's own processes.
Where none can be made, `SlotCgroups.make` returns None and the worker goes on as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "gpupool-"


def own_cgroup() -> Path | None:
    """This process's cgroup v2 directory, or None (no v2 hierarchy mounted)."""
    mount = None
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            dash = fields.index("-")
            if fields[dash + 1] == "cgroup2":
                mount = Path(fields[4])
                break
    if mount is None:
        return None
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return mount / line[3:].strip().lstrip("/")
    return None


class SlotCgroups:
    """This worker's slot cgroups: `slot(n)` for its jobs, `close()` at the end."""

    def __init__(self, top: Path, slots: int) -> None:
        self.top = top
        self.slots = [SlotCgroup(top / f"slot-{n}") for n in range(slots)]

    @classmethod
    def make(cls, worker_id: str, slots: int, dead: Iterable[str] = ()) -> SlotCgroups | None:
        """Create them (blocking: a thread), and remove what the `dead` workers (scratch.SlotDirs
        knows them) left where it is empty; None where the kernel does not let this process (not
        root, no v2 hierarchy, no cgroup.kill)."""
        base = own_cgroup()
        if base is None or os.geteuid() != 0:
            return None
        for stale in dead:
            prune(base / f"{PREFIX}{stale}")  # its orphan guard killed its jobs
        top = base / f"{PREFIX}{worker_id}"
        try:
            top.mkdir()
            for n in range(slots):
                (top / f"slot-{n}").mkdir()
            if not (top / "slot-0" / "cgroup.kill").exists():
                raise OSError("no cgroup.kill: Linux 5.14 or later has it")
        except OSError as exc:
            log.info("jobs run without a cgroup per slot (%s): their leftovers are found through /proc", exc)
            remove(top)
            return None
        return cls(top, slots)

    def slot(self, n: int) -> SlotCgroup:
        return self.slots[n]

    def path(self, slot: int) -> Path:
        return self.slots[slot].path

    def close(self) -> None:
        """Kill what is left in them and remove them. Blocking (a thread)."""
        for cgroup in self.slots:
            cgroup.close()
        remove(self.top)


class SlotCgroup:
    """One slot's cgroup as its jobs use it: where each is born (spawn.py), and the end of what
    it left there. Its directory and files stay open: a slot's cgroup serves all its jobs.

    Writing cgroup.kill leaves a mark on a cgroup: Linux (6.18 at least) SIGKILLs every process
    born in it by clone3 afterwards. A killed cgroup is therefore made anew once empty (it has no
    settings to lose: no controller is enabled); until then a job joins it after birth."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.killed = False  # cgroup.kill was written since the cgroup was made
        self._fds: dict[str, int] = {}  # "" (the directory), "cgroup.kill", "cgroup.events"

    def birthplace(self) -> tuple[int, bool]:
        """The directory, open, for a job to be born in (True) or to join after birth (False)."""
        if self.killed and not self.populated():
            self.close()
            with contextlib.suppress(OSError):
                self.path.rmdir()
                self.killed = False
            self.path.mkdir(exist_ok=True)
        return self._fd("", os.O_RDONLY | os.O_DIRECTORY), not self.killed

    def end(self) -> list[int]:
        """A job's first process has ended: SIGKILL whatever it left here (one write, racing forks
        included) and answer the processes still dying. Nothing is written to an empty cgroup:
        only what is in it could fork into it, and a killed one must be made anew."""
        if not self.populated():
            return []
        with contextlib.suppress(OSError):
            os.write(self._fd("cgroup.kill", os.O_WRONLY), b"1")
        self.killed = True
        return pids(self.path)

    def populated(self) -> bool:
        """Whether any process (any thread) is alive in it: its cgroup.events says."""
        try:
            return b"populated 1" in os.pread(self._fd("cgroup.events", os.O_RDONLY), 256, 0)
        except FileNotFoundError:
            return False

    def _fd(self, name: str, flags: int) -> int:
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = os.open(self.path / name, flags)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def kill(cgroup: Path) -> None:
    """SIGKILL every process in `cgroup` (one write; the kernel stops racing forks too)."""
    (cgroup / "cgroup.kill").write_text("1")


def populated(cgroup: Path) -> bool:
    """Whether any process (any thread) is alive in `cgroup`: its cgroup.events says."""
    try:
        return b"populated 1" in (cgroup / "cgroup.events").read_bytes()
    except FileNotFoundError:
        return False


def pids(cgroup: Path) -> list[int]:
    """The processes still in `cgroup` (the dead have left it: zombies are not listed)."""
    try:
        return [int(line) for line in (cgroup / "cgroup.procs").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def prune(top: Path) -> None:
    """Remove `top` and its cgroups where they are empty; kill nothing."""
    for cgroup in [*sorted(top.glob("slot-*")), top]:
        with contextlib.suppress(OSError):
            cgroup.rmdir()


def remove(top: Path, wait: float = 5.0) -> None:
    """Kill what is in `top`'s cgroups and remove them, waiting up to `wait` s for the dead to
    leave (a cgroup with processes cannot be removed)."""
    deadline = time.monotonic() + wait
    for cgroup in [*sorted(top.glob("slot-*")), top]:
        with contextlib.suppress(OSError):
            kill(cgroup)
        while True:
            try:
                cgroup.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    log.warning("cannot remove cgroup %s: processes are still in it", cgroup)
                    break
                time.sleep(0.01)
