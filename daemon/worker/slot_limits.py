"""A slot's CPU and memory limits (issue 50): the cgroups that hold a job to its `--cpus` and
`--mem`, and that say, once it has ended, whether the kernel killed any of its processes for
memory, the most it used, and the CPU time it had.

Where the kernel has them is cgroup v1's memory, cpu and cpuacct hierarchies (a machine booted
with cgroup v2 alone gives them to v2, where they are not used yet: its jobs run unlimited, with a
line in the worker's log saying so, and claims still fit their CPUs and memory). Each slot has a
directory in each, `gpupool-WORKER/slot-N` under the worker's own, made at start and removed at
the end; a job's first process joins them before it runs anything of the job's (_spawn.c
`joins`), and whatever it starts stays in them. The memory one is made anew for each job, beside
the last (`slot-N.K`, the slot's K-th job): what an earlier job left charged (a file on tmpfs,
page cache, a process of it still being swept) stays with that one's directory, which goes once
empty (its charges to the parent), and reaches neither the next job's limit, its usage nor its
OOM count; nor does setting its limit reclaim anything (the cgroup is empty), which would hold
the thread that sets it for as long as the reclaim took. Before each job its limits are written:

    cpu.cfs_quota_us / cpu.cfs_period_us   N CPUs' time per period (-1: none asked)
    memory.limit_in_bytes                  its --mem (none asked: not written, a new one has none)
    memory.memsw.limit_in_bytes            the same: memory and swap together, so no swap

and the counters read after it: memory.oom_control's `oom_kill` (the kernel's OOM killer ended a
process of it: the job fails saying so, never the worker, which is in none of them),
memory.max_usage_in_bytes and cpuacct.usage. A kernel without swap accounting (swapaccount=0)
has no memsw files: the memory limit alone is written there, and the worker's log says at start
that a job may then swap past its --mem.

A limit that cannot be written (the worker's own cgroup given a lower CPU quota, a slot's
directory removed under it) is the worker's fault, not the job's: runner.py hands the attempt
back, saying why in the worker's log and the job's.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from daemon.worker.cgroups import PREFIX

log = logging.getLogger(__name__)

PERIOD_US = 100_000  # cpu.cfs_period_us: a quota of N CPUs is N periods' time in each
HIERARCHIES = ("memory", "cpu", "cpuacct")
UNLIMITED = b"-1"


def v1_dirs() -> dict[str, Path] | None:
    """This process's cgroup v1 directory in each of HIERARCHIES, or None where one is missing."""
    mounts: dict[str, Path] = {}
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            dash = fields.index("-")
            if fields[dash + 1] == "cgroup":
                for option in fields[dash + 3].split(","):
                    mounts.setdefault(option, Path(fields[4]))
    own: dict[str, Path] = {}
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(","):
                if controller in mounts:
                    own[controller] = mounts[controller] / path.lstrip("/")
    if not all(h in own for h in HIERARCHIES):
        return None
    return {h: own[h] for h in HIERARCHIES}


@dataclass(frozen=True, slots=True)
class Usage:
    """What a job did in its slot: processes the OOM killer ended, its peak memory (bytes) and
    its CPU time (ns)."""

    oom_kills: int
    peak_mem: int
    cpu_ns: int


class SlotLimits:
    """One slot's directories, open: `apply` a job's limits, its `joins` for its first process,
    `usage` once it has ended. `swap`: the kernel accounts swap (memsw files)."""

    def __init__(self, dirs: dict[str, Path], swap: bool = True) -> None:
        self.slot_dirs = dirs  # each hierarchy's slot directory, `slot-N`
        self.dirs = dict(dirs)  # the current job's: the memory one (and any co-mounted) its own
        self.swap = swap
        self._jobs = 0  # the jobs this slot has had: the K of their memory cgroups
        self._earlier: list[Path] = []  # earlier jobs' memory cgroups, not yet empty
        self._fds: list[int] = []
        self._oom_before = 0

    def joins(self) -> tuple[int, ...]:
        """The directories a job's first process joins (open fds, one per hierarchy)."""
        if not self._fds:
            seen = {p: None for p in self.dirs.values()}  # (co-mounted hierarchies share one)
            self._fds = [os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) for p in seen]
        return tuple(self._fds)

    def apply(self, cpus: int, mem: int) -> None:
        """The limits of a job asking for `cpus` CPUs and `mem` bytes (0: no limit), in a memory
        cgroup of its own, new, and its counters from zero. Blocking (a cgroup made and one
        removed, sysfs writes: a thread). OSError: a limit could not be set."""
        self._fresh_memory()
        memory = self.dirs["memory"]
        if mem:  # (memory first: memsw may never be below it)
            _write(memory / "memory.limit_in_bytes", b"%d" % mem)
            if self.swap:
                _write(memory / "memory.memsw.limit_in_bytes", b"%d" % mem)
        cpu = self.dirs["cpu"]
        _write(cpu / "cpu.cfs_period_us", b"%d" % PERIOD_US)
        _write(cpu / "cpu.cfs_quota_us", b"%d" % (cpus * PERIOD_US) if cpus else UNLIMITED)
        _write(self.dirs["cpuacct"] / "cpuacct.usage", b"0")
        self._oom_before = self._oom_kills()

    def _fresh_memory(self) -> None:
        """The next job's memory cgroup, new and empty, beside the last job's; the earlier ones
        removed where empty (their charges go to the parent), the rest on a later call."""
        memory = self.slot_dirs["memory"]
        while True:  # (a worker of the same id before this one may have left one: never reused)
            self._jobs += 1
            fresh = memory.with_name(f"{memory.name}.{self._jobs}")
            try:
                fresh.mkdir()
                break
            except FileExistsError:
                self._earlier.append(fresh)
        last = self.dirs["memory"]
        for hierarchy, path in self.dirs.items():
            if path == last:  # memory, and what is co-mounted with it
                self.dirs[hierarchy] = fresh
        self._earlier.append(last)
        self._earlier = [p for p in self._earlier if not _removed(p)]
        for fd in self._fds:  # the first process joins the new directory
            os.close(fd)
        self._fds.clear()

    def usage(self) -> Usage:
        """What the job that ran since `apply` did."""
        return Usage(
            self._oom_kills() - self._oom_before,
            int((self.dirs["memory"] / "memory.max_usage_in_bytes").read_bytes()),
            int((self.dirs["cpuacct"] / "cpuacct.usage").read_bytes()),
        )

    def _oom_kills(self) -> int:
        for line in (self.dirs["memory"] / "memory.oom_control").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
        return 0

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


class WorkerLimits:
    """This worker's slots' limits: `slot(n)`, `close()` at the end."""

    def __init__(self, tops: list[Path], slots: list[SlotLimits]) -> None:
        self.tops = tops
        self.slots = slots

    @classmethod
    def make(
        cls, worker_id: str, slots: int, dead: Iterable[str] = (), within: dict[str, Path] | None = None
    ) -> WorkerLimits | None:
        """Make them (blocking: a thread) in `within`'s directories, one per hierarchy (default:
        this process's own), and remove what the `dead` workers left; None where the kernel does
        not let this process (not root, no cgroup v1 memory, cpu and cpuacct hierarchies): its
        jobs' --cpus and --mem are then fitted, not enforced."""
        dirs = within or (v1_dirs() if os.geteuid() == 0 else None)
        if dirs is None:
            log.info("jobs' --cpus and --mem are not enforced here: no cgroup v1 memory, cpu and cpuacct")
            return None
        _remove([d / f"{PREFIX}{stale}" for stale in dead for d in dict.fromkeys(dirs.values())])
        tops = list(dict.fromkeys(d / f"{PREFIX}{worker_id}" for d in dirs.values()))
        try:
            for top in tops:
                top.mkdir(exist_ok=True)
                for n in range(slots):
                    (top / f"slot-{n}").mkdir(exist_ok=True)
        except OSError as exc:
            log.info("jobs' --cpus and --mem are not enforced here (%s)", exc)
            _remove(tops)
            return None
        swap = (dirs["memory"] / "memory.memsw.limit_in_bytes").exists()
        if not swap:
            log.warning(
                "jobs' --mem limits their memory here, not their swap: this kernel does not account "
                "swap to cgroups (boot it with swapaccount=1 to hold a job to its --mem, swap included)"
            )
        made = [
            SlotLimits({h: d / f"{PREFIX}{worker_id}" / f"slot-{n}" for h, d in dirs.items()}, swap)
            for n in range(slots)
        ]
        return cls(tops, made)

    def slot(self, n: int) -> SlotLimits:
        return self.slots[n]

    def close(self) -> None:
        """Remove them (every job has ended: they are empty). Blocking (a thread)."""
        for s in self.slots:
            s.close()
        _remove(self.tops)


def _write(path: Path, value: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value)
    finally:
        os.close(fd)


def _removed(cgroup: Path) -> bool:
    """Whether `cgroup` is gone: removed now, or before; False while a process is in it."""
    try:
        cgroup.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _remove(tops: list[Path]) -> None:
    for top in tops:
        for cgroup in [*sorted(top.glob("slot-*")), top]:
            _removed(cgroup)
