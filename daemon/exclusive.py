"""Fields of a job spec that exclude each other, and why: each wants the job's directory to be its own
(and whole GPUs exclude memory on a shared one).

Apart from daemon/job.py, which the server uses to check a whole spec, so that `poolctl enqueue`
can refuse such a command line before it uploads anything without importing the job model.
"""

from __future__ import annotations

from collections.abc import Collection

from daemon.errors import InvalidJob

EXCLUSIVE = (
    ("git", "cwd", "the job runs in its checkout"),
    ("inputs", "cwd", "inputs are placed in the job's own directory"),
    ("snapshot", "cwd", "the job runs in the snapshot"),
    ("snapshot", "git", "the job runs in the snapshot"),
    ("project", "cwd", "the job runs in its project (--workdir none: in a scratch directory)"),
    ("project", "git", "the job runs in its project (--workdir none: in a scratch directory)"),
    ("project", "snapshot", "the job runs in its project"),
)


def check_combination(present: Collection[str]) -> None:
    """Refuse fields that exclude each other (EXCLUSIVE); `present` names the fields a spec has.
    poolctl asks before it uploads anything, the server again when the spec arrives."""
    for field_name, other, why in EXCLUSIVE:
        if field_name in present and other in present:
            raise InvalidJob(field_name, f"cannot be combined with {other}: {why}")


def check_gpu_request(gpus: int, gpu_mem: int) -> None:
    """Refuse whole GPUs and memory on a shared GPU asked together: a job either holds GPUs of its
    own or shares one with other jobs (memory spread over several shared GPUs is nothing a worker
    can place). poolctl asks before it sends the job, the server again when the spec arrives."""
    if gpus and gpu_mem:
        raise InvalidJob(
            "gpu_mem",
            "--gpu-mem asks for memory on one shared GPU; drop --gpus (or --gpu-mem for whole GPUs)",
        )
