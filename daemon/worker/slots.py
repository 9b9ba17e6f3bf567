"""A worker's slots as the machine sees them: their scratch directories (scratch.py), their uids
(identity.py), their cgroups (cgroups.py), the spawner that starts, reaps and ends their jobs
(spawn.py) and the orphan guard that ends those jobs should the worker die (orphan_guard.py).

They are opened together at the worker's start and closed together at its end, each in the order
the others need: the directories first (they say which workers are dead, whose cgroups go), the
guard before any job can start; closed the other way round. With slot uids, the data directory is
made passable (never listable) to them, and each uid is swept at the start (its processes,
temporary files and IPC objects, uid_sweep.py): a worker that died may have left them.

A worker the server runs for an agent (hosted.py) has slots that are another machine's: its
`Slots` are not `local`, and nothing of this machine is opened or closed for them.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from daemon.aio import start_or_undo
from daemon.worker.cgroups import SlotCgroup, SlotCgroups
from daemon.worker.confine import Confinement
from daemon.worker.dir_watch import DirWatch
from daemon.worker.identity import IdentityError, SlotIdentity, check_passable
from daemon.worker.orphan_guard import OrphanGuard
from daemon.worker.scratch import SlotDirs, SlotScratch
from daemon.worker.slot_limits import SlotLimits, WorkerLimits
from daemon.worker.spawn import Spawner

log = logging.getLogger(__name__)


class Slots:
    """`count` slots of worker `worker_id` under `data_dir`; `identities`: one uid per slot, or
    None (the jobs run as the worker's own); `job_nice`: how much nicer than the worker its jobs
    run; `confinement`: what jobs with a uid give up (confine.py); `local`: False for slots on
    another machine (an agent's, hosted.py), for which nothing here is opened: no directories,
    uids, cgroups or orphan guard. `open()` once, `close()` at the end (safe twice)."""

    def __init__(
        self,
        data_dir: Path,
        worker_id: str,
        count: int,
        identities: Sequence[SlotIdentity] | None,
        job_nice: int = 0,
        *,
        confinement: Confinement | None = None,
        local: bool = True,
    ) -> None:
        self.data_dir = data_dir
        self.local = local
        self.worker_id = worker_id
        self.count = count
        self.identities = list(identities) if identities is not None else None
        self.dirs = SlotDirs(data_dir / "slots", worker_id)
        self.scratch = [
            SlotScratch(self.dirs.slot(n), (i.uid, i.gid) if (i := self.identity(n)) is not None else None)
            for n in range(count)
        ]
        self.watch: DirWatch | None = None  # which of their directories the jobs changed (at open)
        self.guard = OrphanGuard(f"GPUPOOL_WORKER={worker_id}", [i.uid for i in self.identities or ()])
        self.spawner = Spawner(job_nice, confinement)
        self.cgroups: SlotCgroups | None = None  # one per slot, where the kernel lets us (at open)
        self.limits: WorkerLimits | None = None  # their CPU and memory limits, the same

    def dir(self, slot: int) -> Path:
        """The slot's scratch directories' parent (scratch.py)."""
        return self.dirs.slot(slot)

    def identity(self, slot: int) -> SlotIdentity | None:
        return self.identities[slot] if self.identities is not None else None

    def cgroup(self, slot: int) -> SlotCgroup | None:
        return self.cgroups.slot(slot) if self.cgroups is not None else None

    def limit(self, slot: int) -> SlotLimits | None:
        return self.limits.slot(slot) if self.limits is not None else None

    async def open(self) -> None:
        """Everything the slots need, in order; on failure what was opened is closed again."""
        if self.local:
            await start_or_undo(self._open, self.close)

    async def _open(self) -> None:
        self._prepare_data_dir()
        dead = await asyncio.to_thread(self.dirs.open)
        self.watch = DirWatch()
        for scratch in self.scratch:
            scratch.watch = self.watch
        self.cgroups = await asyncio.to_thread(SlotCgroups.make, self.worker_id, self.count, dead)
        self.limits = await asyncio.to_thread(WorkerLimits.make, self.worker_id, self.count, dead)
        await self.guard.start()
        if self.identities:
            await self.spawner.check(self.identities[0])
        elif self.spawner.confinement.own_net and self.count:
            raise IdentityError(
                'job_network = "private" needs jobs with uids of their own: a root worker with '
                "job_uid_range (a job running as the worker's user or as root would share its network)"
            )
        for identity in self.identities or ():  # what a worker that died left of its jobs
            await self.spawner.sweep(identity)

    async def close(self) -> None:
        """The spawner, the guard, the cgroups, the directories' lock: every job has ended.
        Safe after a failed open, and twice."""
        await self.spawner.close()
        if not self.local:
            return  # nothing else was opened
        await self.guard.stop()
        if self.cgroups is not None:
            await asyncio.to_thread(self.cgroups.close)
            self.cgroups = None
        if self.limits is not None:
            await asyncio.to_thread(self.limits.close)
            self.limits = None
        await asyncio.to_thread(self.dirs.close)
        if self.watch is not None:
            self.watch.close()
            self.watch = None

    def _prepare_data_dir(self) -> None:
        if self.identities is not None:
            # The jobs' uids must reach their slot's directories, and nothing else in data_dir:
            # traversable (--x), never listable, by others; what is secret in it is 0600/0700.
            for path in (self.data_dir, self.dirs.root, self.dirs.dir):
                path.mkdir(parents=True, exist_ok=True)
                path.chmod(0o711)
            for path in (self.data_dir / "cache", self.data_dir / "git"):  # every user's data
                path.mkdir(parents=True, exist_ok=True)
                path.chmod(0o700)
            check_passable(self.data_dir)
        elif os.geteuid() == 0 and self.count:
            log.warning(
                'worker %s runs its jobs as root (job_uid_range = "root"), with every credential '
                "of this daemon: leave job_uid_range empty, or give it a range, to run each slot's "
                "jobs as a uid of its own (docs/SECURITY.md)",
                self.worker_id,
            )
