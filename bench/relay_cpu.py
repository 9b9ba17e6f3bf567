"""What a route's relay costs (bench/interactive.py): the CPU time (user and system) that the
processes between the two ends of a route used, by role (gpupool's poold, its redis-server and
`poolctl forward`; ssh's client and sshd), read from /proc as snapshots and subtracted. Neither
end counts (the bench, the job's server, `cat`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import psutil

Cpu = dict[str, float]  # CPU seconds (user and system) by the role of the processes that used them
Roles = Callable[[], dict[str, list[psutil.Process]]]
# The far ends' command lines (bench/interactive.py's JOB_SERVER, and `cat`): not the relay's.
ENDS = (["/usr/bin/python3", "-u", "-c"], ["cat"])


def is_end(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return any(proc.cmdline()[: len(end)] == end for end in ENDS)
    return True


def pool_roles(poold: psutil.Process, forward: asyncio.subprocess.Process | None = None) -> Roles:
    """The pool's relay: poold (the server and its worker, one process as `make run` starts it,
    and its helpers), its redis-server, and `poolctl forward`; not the job's processes."""
    client = [psutil.Process(forward.pid)] if forward is not None else []

    def roles() -> dict[str, list[psutil.Process]]:
        kids = [p for p in poold.children(recursive=True) if not is_end(p)]
        redis = [p for p in kids if p.name() == "redis-server"]
        found = {"poold": [poold, *(p for p in kids if p not in redis)], "redis-server": redis}
        return found | ({"poolctl forward": client} if client else {})

    return roles


def ssh_roles(ssh: asyncio.subprocess.Process, sshd: psutil.Process) -> Roles:
    """ssh's relay: the ssh client and the private sshd's processes, not the command it runs."""
    client = psutil.Process(ssh.pid)

    def roles() -> dict[str, list[psutil.Process]]:
        return {"ssh": [client], "sshd": [sshd, *(p for p in sshd.children(recursive=True) if not is_end(p))]}

    return roles


Snapshot = dict[str, dict[tuple[int, float], float]]  # role -> (pid, its start) -> CPU seconds so far


def used_between(before: Snapshot, after: Snapshot) -> Cpu:
    """What each role used between two snapshots (a process born between counts from nothing;
    one gone between is lost, and none is: the relays' processes are long-lived)."""
    return {
        role: sum(used - before.get(role, {}).get(key, 0.0) for key, used in procs.items())
        for role, procs in after.items()
    }


def snapshot(roles: Roles) -> Snapshot:
    """CPU seconds each of the processes `roles()` finds has used so far, by role."""
    used: Snapshot = {}
    for role, procs in roles().items():
        used[role] = {}
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                used[role][(proc.pid, proc.create_time())] = times.user + times.system
    return used
