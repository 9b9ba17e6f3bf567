"""A worker's CPUs and memory as jobs may have them (issue 50): what it advertises, and what a
claim may still fit of them with its GPUs (queue/lua/claim/host.lua).

CPUs are those this process may run on (its affinity: a worker started under `taskset`, or in a
cpuset, has those alone), memory the machine's less `worker_reserved_mem`, kept for the system and
the worker itself. What the jobs it holds asked for (`--cpus`, `--mem`) is counted out; a job that
asked for none counts for none, and its slot's cgroup sets it no limit (cgroups.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from daemon.worker.attempt import HeldAttempt, boottime


def machine_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) or 1


def machine_memory() -> int:
    """The machine's memory in bytes (/proc/meminfo's MemTotal)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemTotal")


@dataclass(frozen=True, slots=True)
class HostResources:
    """The CPUs and bytes of memory a worker's jobs may have in all."""

    cpus: int
    mem: int

    @classmethod
    def of_machine(cls, reserved_mem: int) -> HostResources:
        """This machine's, `reserved_mem` bytes kept back for the system (at least one MiB is left)."""
        return cls(machine_cpus(), max(2**20, machine_memory() - reserved_mem))

    def free(self, held: Iterable[HeldAttempt]) -> tuple[int, int]:
        """The CPUs and bytes free once the `held` attempts' are counted out."""
        specs = [h.lease.spec for h in held]
        return self.cpus - sum(s.cpus for s in specs), self.mem - sum(s.mem for s in specs)


def host_ends(held: Iterable[HeldAttempt], grace: float) -> list[tuple[float | None, int, int]]:
    """When each attempt holding CPUs or memory ends at the latest, in seconds from now (its time
    limit plus its stop grace, else `grace`; None: no limit), with its CPUs and bytes: for a
    claim's backfill, as attempt.py `latest_ends` is for GPUs."""
    now = boottime()
    out: list[tuple[float | None, int, int]] = []
    for h in held:
        spec = h.lease.spec
        if spec.cpus or spec.mem:
            stop_grace = grace if spec.stop_grace is None else spec.stop_grace
            left = None if spec.timeout is None else max(0.0, h.since + spec.timeout + stop_grace - now)
            out.append((left, spec.cpus, spec.mem))
    return out
