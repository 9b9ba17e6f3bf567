"""A worker's own side, as the scheduler's model (scheduler_model.py) plays it (issue 46): its
GPUs in the real allocator a worker keeps (daemon/worker/gpus.py), what it holds, and what its
claims say of it, as worker/dispatcher.py `_room` builds that; and when a head could start on it,
as claim.lua's backfill reckons it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from daemon.job import Lease
from daemon.queue.claims import Capacity, SharedGpu
from daemon.worker.gpus import GpuAllocator, GpuInfo

GIB = 2**30
GPU_MEMORY = 16 * GIB  # every GPU's
JOBS_PER_GPU = 2  # gpu_max_jobs of every worker here
GRACE = 1.0  # every job's stop grace, and the workers' kill grace

# The model's clock stands still: every attempt has all of its time limit left, as it nearly has
# in the few milliseconds an example takes. So what a claim is told of its worker (`ends`) is the
# same each time hypothesis replays an example, and so is what the claim does.
CLOCK = 0.0


@dataclass
class Worker:
    """One worker's own side: its GPUs (the real allocator a worker keeps) and what it holds."""

    name: str
    gpus: int
    slots: int
    allocator: GpuAllocator = field(init=False)
    # lease id -> (lease, its slot, when it started on the model's clock)
    held: dict[str, tuple[Lease, int, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        infos = [GpuInfo(i, f"GPU-{self.name}-{i}", "model", GPU_MEMORY) for i in range(self.gpus)]
        self.allocator = GpuAllocator(infos, self.slots, JOBS_PER_GPU)

    def room(self, *, shared: bool = True) -> Capacity:
        """What this worker's claims say of it, as worker/dispatcher.py `_capacity` builds it."""
        a = self.allocator
        now = CLOCK
        ends: list[tuple[float | None, int]] = []
        for lease, _slot, since in self.held.values():
            if g := len(a.held_by(lease.id)):
                t = lease.spec.timeout
                ends.append((None if t is None else max(0.0, since + t + GRACE - now), g))
        room = Capacity(a.free_count(), a.share, len(a.gpus), ends, GRACE)
        if shared and a.gpus:
            uuids = [g.uuid for g in a.gpus]
            whole = {g.uuid for g in a.free()}
            table = [
                SharedGpu(uuids.index(r.uuid), r.avail, r.jobs, r.uuid not in whole) for r in a.shared_table()
            ]
            room = dataclasses.replace(room, shared=table, largest_gpu=GPU_MEMORY)
        return room

    def take(self, lease: Lease) -> None:
        """Give a claimed job its slot and GPUs as the dispatcher does; a claim beyond this worker's
        means fails here (NotEnoughGpus), as it would there."""
        slot = min(set(range(self.slots)) - {s for _, s, _ in self.held.values()})
        if lease.spec.gpu_mem:
            uuid = self.allocator.gpus[lease.shared_gpu].uuid
            self.allocator.allocate_shared(lease.id, uuid, lease.spec.gpu_mem)
        else:
            self.allocator.allocate(lease.id, lease.spec.gpus, slot)
        self.held[lease.id] = (lease, slot, CLOCK)

    def drop(self, lease: Lease) -> None:
        del self.held[lease.id]
        self.allocator.release(lease.id)


def earliest_ms(room: Capacity, need: int) -> int:
    """When `need` GPUs could be free at the earliest on a worker whose claim said `room`, in ms
    from now, as claim.lua's backfill reckons it: its running jobs end at their limits (one
    without a limit any moment), and GPUs in use that no end accounts for any moment too."""
    ends = sorted((0 if t is None else max(0, round(t * 1000)), g) for t, g in room.ends)
    free = room.total - sum(g for _ms, g in ends)
    for ms, g in [(0, 0), *ends]:
        free += g
        if free >= need:
            return ms
    return 0
