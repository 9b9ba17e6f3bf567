"""Whether one worker could ever hold a job whole (issue 50): its CPUs, its memory and its GPUs
(or the memory it shares on one GPU) on one worker. The most CPUs of one worker and the memory or
GPUs of another hold no job that needs both. Admission refuses a job that no registered worker
serving its queue holds (admission.py); `poolctl show` says so of a queued one that no live worker
serving its queue holds (pending.py): one check for both.

A worker is its registration as a dict (queue/registry.py): `cpus` and `job_memory`, its CPUs and
bytes of memory for jobs (`job_memory` 0: it does not count them, as an agent's, and fits any
job's), and `gpus`, each with its `memory`."""

from __future__ import annotations

from typing import Any

from daemon.job import JobSpec


def holds_gpus(spec: JobSpec, gpus: list[dict[str, Any]]) -> bool:
    """Whether a worker with `gpus` could hold the job's: so many GPUs, or one with the memory it
    shares (--gpu-mem)."""
    if spec.gpu_mem:
        return any(int(g.get("memory", 0)) >= spec.gpu_mem for g in gpus)
    return spec.gpus <= len(gpus)


def none_holds(spec: JobSpec, workers: list[dict[str, Any]]) -> bool:
    """Whether no one of `workers` could ever hold the job whole. Never for a job that asks for
    no CPUs and no memory (its GPUs alone: the scheduler's verdict says whether a worker has that
    many), nor with no workers, nor where one of them does not count CPUs and memory."""
    if not (spec.cpus or spec.mem) or not workers or not all(int(w.get("job_memory") or 0) for w in workers):
        return False
    return not any(
        spec.cpus <= int(w.get("cpus", 0))
        and spec.mem <= int(w["job_memory"])
        and holds_gpus(spec, w.get("gpus") or [])
        for w in workers
    )


def needs(spec: JobSpec) -> str:
    """What the job needs on one worker, in words: '16 CPUs and 60.0 GiB of memory'."""
    said = [f"{spec.cpus} CPUs"] if spec.cpus else []
    said += [f"{spec.mem / 2**30:.1f} GiB of memory"] if spec.mem else []
    said += [f"{spec.gpus} GPUs"] if spec.gpus else []
    said += [f"{spec.gpu_mem / 2**30:.1f} GiB on one GPU"] if spec.gpu_mem else []
    return " and ".join(said)
