"""Why queued jobs wait, as the scheduler itself judges them (lua/explain.lua runs the claim's own
parts, read only): where each job sits, the verdict a claim by the queue's biggest live worker
would give it now and why, and in a fair-share queue its user's standing. `poolctl show`, `ls` and
the dashboard put these in words (server/pending.py); no policy is written twice."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from daemon.queue.claims import Capacity, SharedGpu
from daemon.queue.reads import _s

if TYPE_CHECKING:
    from daemon.queue.claims import Claims

EXPLAINED_AT_ONCE = 500  # job ids per script call: a bounded stretch of Redis time


@dataclass(frozen=True)
class Explanation:
    """One queued job, as a claim judges it (claim/fit.lua `verdict`): `place` ('front', 'parked',
    'held', 'prio', 'stream', 'waiting', 'backoff', 'running', 'gone'), `verdict` ('start', 'wait',
    'hold', 'park', 'gone') and its `reason` code; its user's recent use (GPU-seconds), weight and
    jobs running in the queue; and, with fair share, the users whose turn comes first."""

    job_id: str
    place: str
    verdict: str
    reason: str
    use: float
    weight: float
    running: int
    first: tuple[str, ...]


async def explain(
    queue: Claims,
    q: str,
    job_ids: Sequence[str],
    gpus_most: int,
    largest_gpu: int = 0,
    *,
    host_most: tuple[int, int] = (0, 0),
) -> dict[str, Explanation]:
    """How a claim in queue `q` by a worker of `gpus_most` GPUs, all free, whose largest GPU has
    `largest_gpu` bytes, and with `host_most` CPUs and bytes of memory for jobs, all free ((0, 0):
    not counted), would judge each of `job_ids` (jobs of `q`) now."""
    out: dict[str, Explanation] = {}
    whole = [SharedGpu(0, largest_gpu, 2**31, shared=False)] if gpus_most and largest_gpu else []
    cpus, mem = host_most
    capacity = Capacity(
        gpus_free=gpus_most,
        gpus_total=gpus_most,
        shared=whole,
        largest_gpu=largest_gpu,
        cpus_free=cpus,
        cpus_total=cpus,
        mem_free=mem,
        mem_total=mem,
    )
    request = queue._request("explain", q, 0, 0, capacity)
    for i in range(0, len(job_ids), EXPLAINED_AT_ONCE):
        rows = await queue.scripts.explain(
            keys=request.keys(), args=[request.packed(), *job_ids[i : i + EXPLAINED_AT_ONCE]]
        )
        for job_id, place, verdict, reason, use, weight, running, first in rows:
            out[_s(job_id)] = Explanation(
                _s(job_id),
                _s(place),
                _s(verdict),
                _s(reason),
                float(use) / 1000,
                float(weight),
                int(running),
                tuple(_s(first).split()),
            )
    return out
