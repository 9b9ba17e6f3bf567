"""A job that failed by itself on a GPU that failed under it: its end is the GPU's, not its own.

A failing GPU most often kills its job before the health watch sees the fault (health_watch.py):
the program gets a CUDA error and exits 1 a moment after an Xid 79 or an uncorrectable ECC error.
So as a job that failed by itself ends, the GPUs it held are checked (`HealthWatch.fault_under`)
for a fault that kills programs (`KILLING`); `gpu_health_policy` then decides, as when the watch
stops a job: "requeue" hands it back (a loss towards max_attempts; a shell ends instead, since it
is never requeued: JobRun.hand_back), "let_finish" lets its end stand, naming the fault. A job
that succeeded, that ended another way (its user's cancel, a timeout, a stop), or that the
kernel's OOM killer ended (its own memory, whatever its GPUs did) ends as it did.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

# The faults that kill the programs on a GPU (gpu_health.FAULTS; `hung`: its driver stopped
# answering), one word each (health_watch.py's LASTING puts them before the slowdowns). A slowdown
# (thermal, power) slows them and no more: a job that fails on a hot GPU failed of its own.
KILLING = frozenset({"lost", "ecc", "xid", "pages", "hung"})


@dataclass(frozen=True, slots=True)
class GpuFaulted:
    """A fault that kills programs on a GPU of a job that failed by itself: `what` says which GPU
    and what fault; `hand_back`: `gpu_health_policy` hands the job back for it ("requeue"), else
    ("let_finish") its end stands, the fault in its detail."""

    what: str
    hand_back: bool

    def why(self, how: str) -> str:
        """The sentence of the job's log (and of its detail, handed back), `how` it ended."""
        if self.hand_back:
            return f"{self.what}; the job ended on it ({how}): back to its queue to run on a sound GPU"
        return f"{self.what}; the job ended on it ({how}): its end stands (gpu_health_policy let_finish)"


# What a job's end asks of the health watch: the fault of its GPUs, if one kills programs
FaultCheck = Callable[[], Awaitable[GpuFaulted | None]]


async def gpu_fault_end(check: FaultCheck | None, returncode: int, out_of_memory: bool) -> GpuFaulted | None:
    """The fault that ended a job which ended by itself with `returncode`, if its GPUs (`check`;
    None: not watched) show one that kills programs; None for a success, or an end of its own
    memory (`out_of_memory`: the OOM killer ended a process of it)."""
    if check is None or returncode == 0 or out_of_memory:
        return None
    return await check()
