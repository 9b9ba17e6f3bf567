"""What a run of one attempt is, and what its end says: the words every worker module shares.

`Ending` (why a job's processes ended, which decides what is recorded), `RunResult` (what a run
hands back), `Run` (what a worker asks of an attempt: runner.JobRun, hosted.py's attempt on an
agent, or a benchmark's no-op executor), `describe_exit` (a process's end in a shell's words), and
a job's environment (`passed_env`, `job_env`: what it gets of the worker's, and the pool's
variables).

Apart from runner.py, which holds the processes of one attempt (JobRun): the dispatcher, the
outcomes, the GPU policies, the agent and the benchmarks speak of a run's end without importing
how one is run.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from daemon.job import Lease, Outcome
from daemon.worker.gpus import GpuInfo, visible_devices


class Ending(enum.StrEnum):
    """Why the job's processes ended, which decides what is recorded."""

    EXITED = "exited"  # by itself: SUCCEEDED on 0, FAILED otherwise
    CANCELLED = "cancelled"  # the user cancelled: CANCELLED
    TIMED_OUT = "timed out"  # spec.timeout passed: FAILED
    IDLE = "idle"  # a tty job had no input for its idle limit: FAILED
    HANDED_BACK = "handed back"  # stopped by a drain or a requeue: the attempt goes back to the queue
    STOPPED = "stopped"  # a tty job a drain or a requeue stopped: FAILED (a shell is never requeued)
    LOST = "lost"  # the lease is gone: killed at once, nothing recorded (it is not ours any more)


@dataclass(frozen=True, slots=True)
class RunResult:
    ending: Ending
    outcome: Outcome | None  # what to complete the attempt with; None for HANDED_BACK and LOST
    dirty_gpus: Mapping[str, str] = field(default_factory=dict)  # GPU uuid -> why
    killed_by: int | None = None  # the signal that ended the job's first process, if one did
    # Handed back by the pool's policies (idle GPUs, a GPU fault, a slot's limits this worker
    # could not set): a loss towards max_attempts.
    by_policy: bool = False
    # What its GPUs did (gpu_usage.py; set by gpu_watch.py): an outcome carries it in its result,
    # a hand-back passes it on, so that the attempt's accounting has its efficiency either way.
    gpu_usage: Mapping[str, Any] | None = None
    # Why the pool's policies handed it back (by_policy): the job's detail until its next end
    why: str = ""


class Run(Protocol):
    """What a worker asks of an attempt: JobRun, or a benchmark's no-op executor."""

    lease: Lease
    gpus: tuple[GpuInfo, ...]

    @property
    def exited(self) -> bool:
        """The job's first process has ended (known as soon as the loop sees it)."""

    @property
    def stopping(self) -> bool:
        """How the attempt ends is decided: a stop was asked (the first one asked decides), or
        its first process has ended. The idle-GPU policy asks first (gpu_watch.py), so that it
        never takes an end as its own that was another's."""

    def start(self) -> None:
        """Start its processes now, in the caller's turn, if nothing has to come first (else
        `run` starts them)."""

    async def run(self) -> RunResult: ...
    async def tidy(self) -> None:
        """After `run`: leave what the attempt used (its slot's directories) ready for the next."""

    def cancel(self) -> None: ...
    def hand_back(
        self, now: bool = False, why: str = "the worker is stopping", by_policy: bool = False
    ) -> None:
        """Stop it so the attempt goes back to its queue; `by_policy`: the pool's GPU policies
        ask (idle GPUs, a GPU fault), and the hand-back is a loss towards max_attempts."""

    def lose(self, why: str) -> None: ...
    def note(self, text: str) -> None:
        """A line of the pool's own in the job's log ("[gpupool] ...")."""


# What a job gets of the worker's environment: enough to find programs and speak the user's
# language. Nothing else: the daemon's environment may hold secrets (credentials of its own,
# systemd's notify socket, through which a job could speak for the daemon).
PASSED_ENV = frozenset({"PATH", "HOME", "LANG", "LANGUAGE", "TZ", "TERM"})


def passed_env(base: Mapping[str, str]) -> dict[str, str]:
    """What a job gets of `base`, the worker's environment: PASSED_ENV and the locale (LC_*)."""
    return {k: v for k, v in base.items() if k in PASSED_ENV or k.startswith("LC_")}


def job_env(
    base: Mapping[str, str],
    lease: Lease,
    gpus: Sequence[GpuInfo],
    home: Path | None = None,
    tmp: Path | None = None,
) -> dict[str, str]:
    """The job's environment: PASSED_ENV and the locale (LC_*) from the worker's, HOME set to `home`
    and TMPDIR to `tmp` when given (a job with an identity of its own gets its slot's directories:
    what it leaves in a temporary file goes with the attempt, not to the next user of the slot's
    uid), then the spec's, then the pool's variables, which the spec cannot override."""
    env = passed_env(base)
    if home is not None:
        env["HOME"] = str(home)
    if tmp is not None:
        env["TMPDIR"] = str(tmp)
    env.update(lease.spec.env)
    env.update(
        GPUPOOL_JOB_ID=lease.job_id,
        GPUPOOL_ATTEMPT=str(lease.attempt),
        GPUPOOL_ATTEMPT_ID=lease.id,
        GPUPOOL_QUEUE=lease.queue,
        GPUPOOL_WORKER=lease.worker,
        CUDA_VISIBLE_DEVICES=visible_devices(gpus),
    )
    if lease.spec.gpu_mem:  # the memory it declared on its shared GPU, to size its batches by
        env["GPUPOOL_GPU_MEM"] = str(lease.spec.gpu_mem)
    if lease.spec.array:  # one of an array (poolctl enqueue --array/--sweep)
        env.update(GPUPOOL_ARRAY_ID=lease.spec.array, GPUPOOL_ARRAY_INDEX=str(lease.spec.array_index))
    return env


def describe_exit(returncode: int) -> tuple[int, str]:
    """(exit code as a shell reports it, words): a signal N becomes 128+N."""
    if returncode >= 0:
        return returncode, f"exited with status {returncode}"
    sig = -returncode
    try:
        name = f" ({signal.Signals(sig).name})"
    except ValueError:
        name = ""
    return 128 + sig, f"killed by signal {sig}{name}"
