"""A slot's CPU and memory limits (issue 50): the cgroups that hold a job to its `--cpus` and
`--mem`, and that say, once it has ended, whether the kernel killed any of its processes for
memory, the most it used, and the CPU time it had.

Where the kernel has them is cgroup v1's memory, cpu and cpuacct hierarchies (a machine booted
with cgroup v2 alone gives them to v2, where they are not used yet: its jobs run unlimited, with a
line in the worker's log saying so, and claims still fit their CPUs and memory). Each slot has a
directory in each, `gpupool-WORKER/slot-N` under the worker's own, made at start and removed at
the end (the memory one made anew for each job: nothing the last one left charged, a file on
tmpfs, counts against the next); a job's first process joins them before it runs anything of the
job's (_spawn.c `joins`), and whatever it starts stays in them. Before each job its limits are
written:

    cpu.cfs_quota_us / cpu.cfs_period_us   N CPUs' time per period (-1: none asked)
    memory.limit_in_bytes                  its --mem (-1: none asked)
    memory.memsw.limit_in_bytes            the same: memory and swap together, so no swap

and the counters read after it: memory.oom_control's `oom_kill` (the kernel's OOM killer ended a
process of it: the job fails saying so, never the worker, which is in none of them),
memory.max_usage_in_bytes and cpuacct.usage. A kernel without swap accounting (swapaccount=0)
has no memsw files: the memory limit alone is written there, and the worker's log says at start
that a job may then swap past its --mem.
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
        self.dirs = dirs
        self.swap = swap
        self._fds: list[int] = []
        self._oom_before = 0

    def joins(self) -> tuple[int, ...]:
        """The directories a job's first process joins (open fds, one per hierarchy)."""
        if not self._fds:
            seen = {p: None for p in self.dirs.values()}  # (co-mounted hierarchies share one)
            self._fds = [os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) for p in seen]
        return tuple(self._fds)

    def apply(self, cpus: int, mem: int) -> None:
        """The limits of a job asking for `cpus` CPUs and `mem` bytes (0: no limit), and its
        counters from zero. Blocking (sysfs writes and a memory cgroup made anew: microseconds)."""
        memory, cpu = self.dirs["memory"], self.dirs["cpu"]
        self._fresh_memory()
        # The last job's limits lifted first (memsw, then memory: memsw may never be below the
        # memory limit), then this one's set (memory, then memsw).
        memsw = memory / "memory.memsw.limit_in_bytes"
        if self.swap:
            _write(memsw, UNLIMITED)
        _write(memory / "memory.limit_in_bytes", UNLIMITED)
        if mem:
            _write(memory / "memory.limit_in_bytes", b"%d" % mem)
            if self.swap:
                _write(memsw, b"%d" % mem)
        _write(memory / "memory.max_usage_in_bytes", b"0")
        _write(cpu / "cpu.cfs_period_us", b"%d" % PERIOD_US)
        _write(cpu / "cpu.cfs_quota_us", b"%d" % (cpus * PERIOD_US) if cpus else UNLIMITED)
        _write(self.dirs["cpuacct"] / "cpuacct.usage", b"0")
        self._oom_before = self._oom_kills()

    def _fresh_memory(self) -> None:
        """The slot's memory cgroup made anew, empty, for the next job: what the last one left
        charged (a file on tmpfs, /dev/shm, which no reclaim frees without swap) goes to the
        parent, and reaches neither this job's limit (which could not be set below it: EBUSY) nor
        its usage; nor does lowering a limit reclaim the last job's page cache on the event loop.
        A cgroup some process of the last job is still in (being swept) stays as it is."""
        memory = self.dirs["memory"]
        with contextlib.suppress(OSError):
            memory.rmdir()
        memory.mkdir(exist_ok=True)
        if self._fds:  # the first process joins the new directory
            for fd in self._fds:
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


def _remove(tops: list[Path]) -> None:
    for top in tops:
        for cgroup in [*sorted(top.glob("slot-*")), top]:
            with contextlib.suppress(OSError):
                cgroup.rmdir()
