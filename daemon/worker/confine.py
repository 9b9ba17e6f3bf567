"""What a job running as a slot's uid may reach of its machine beyond what it was given, and what
its first process is made to give up before its exec (_spawn.c does it, as root, before the switch).

- GPUs: each NVIDIA GPU device node (/dev/nvidiaN, N its minor number) the job was not given is
  made unopenable in a mount namespace of the job's own, as container runtimes do:
  CUDA_VISIBLE_DEVICES alone confines only a job that keeps it. The shared nodes (/dev/nvidiactl,
  /dev/nvidia-uvm, /dev/nvidia-caps: a MIG device's own capabilities) stay; a MIG device's node
  is its GPU's.
- IPC: a namespace of its own, so the System V objects and POSIX message queues it makes are
  seen by no other job and go with it.
- Network (`job_network`): "host" shares the machine's network, loopback included: the jobs of a
  machine reach each other's loopback ports and abstract unix sockets. "private" gives each job a
  namespace of its own with only its loopback, up: nothing of another job's, and no route out
  (a job that downloads anything needs "host").
- Keyrings (always, with a uid): a session keyring of its own, and its uid's keyrings emptied (its
  user keyrings locked out of the uid's reach, so that no job can put a key there or have them
  replaced: a job keeps its keys in its own session keyring; see _spawn.c).

Nothing here applies to a job running as the worker's own user (no uid of its own): it could not
be done without privileges, and a job running as root would undo it.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Collection
from dataclasses import dataclass

JOB_NETWORKS = ("host", "private")
DEV = "/dev"
NVIDIA_MAJOR = 195  # the NVIDIA driver's character devices (nvidia-frontend)
GPU_NODE = re.compile(r"nvidia[0-9]+")  # /dev/nvidia0...: one per GPU; not nvidiactl, nvidia-uvm, ...
MTIME_SLACK_NS = 100_000_000  # a directory's times move in ticks of the coarse clock (<= 10 ms)


@dataclass(frozen=True, slots=True)
class Plan:
    """What one job's first process gives up (the arguments _spawn.spawn takes for it)."""

    hidden: tuple[bytes, ...] = ()  # device nodes it may not open
    own_ipc: bool = False
    own_net: bool = False


NOTHING = Plan()


class Confinement:
    """The plans of a worker's jobs. `job_network`: "host" or "private" (see the module doc)."""

    def __init__(self, job_network: str = "host") -> None:
        if job_network not in JOB_NETWORKS:
            raise ValueError(f"job_network must be one of {', '.join(JOB_NETWORKS)}, not {job_network!r}")
        self.own_net = job_network == "private"
        self._seen = -1  # the st_mtime_ns of DEV when `_nodes` was read from it
        self._nodes: dict[int, bytes] = {}  # minor number -> GPU device node

    def plan(self, gpus: Collection[int] | None) -> Plan:
        """The plan of a job given the GPUs whose minor numbers are `gpus` (None: the worker does
        not know them, and leaves every GPU node as it is)."""
        if gpus is None:
            return Plan((), own_ipc=True, own_net=self.own_net)
        hidden = tuple(node for minor, node in self.nodes().items() if minor not in gpus)
        return Plan(hidden, own_ipc=True, own_net=self.own_net)

    def nodes(self) -> dict[int, bytes]:
        """The machine's GPU device nodes, by minor number. Read again only when the directory
        changed (one stat per job: nodes made after the worker started, by a driver loaded
        late, are hidden as well)."""
        try:
            seen = os.stat(DEV).st_mtime_ns
        except OSError:
            return {}
        if seen != self._seen:
            now = time.time_ns()
            nodes = {}
            with os.scandir(DEV) as entries:
                for entry in entries:
                    if GPU_NODE.fullmatch(entry.name):
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == NVIDIA_MAJOR:
                            nodes[os.minor(st.st_rdev)] = os.fsencode(entry.path)
            # A node made in the tick of the last change would not move the time: a time that
            # recent is read again next time.
            self._nodes, self._seen = nodes, seen if seen < now - MTIME_SLACK_NS else -1
        return self._nodes
