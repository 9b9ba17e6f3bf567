"""What an attempt's end records besides how it was stopped: its result (when it ran, what it
used, its output's tail, its artifacts), and the outcome of a job that ended by itself (out of
memory, succeeded, or failed, naming its GPU's fault).

Apart from runner.py, which holds the attempt's processes and decides how it ended (its Ending,
and the sentence of a stop): these build the record from what the run hands them, and touch none
of its state.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from daemon.job import JobState, Outcome
from daemon.worker.gpus import GpuInfo
from daemon.worker.slot_limits import Usage

TAIL_LINES = 20  # lines of output kept in the outcome


def result(
    *,
    peak_rss: int,
    started: float,
    gpus: Sequence[GpuInfo],
    tail: list[str],
    returncode: int | None,
    usage: Usage | None,
    extra: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """An outcome's result: its peak RSS, when it ran, its GPUs, the `tail` of its output, `extra`
    (its artifacts), the signal that ended it (a negative `returncode`), and what it used under
    its slot's limits (`usage`: None when they are not enforced)."""
    out: dict[str, Any] = {
        "peak_rss": peak_rss,
        "started_at": started,
        "ended_at": time.time(),
        "gpus": [g.uuid for g in gpus],
        "tail": tail,
        **(extra or {}),
    }
    if returncode is not None and returncode < 0:
        out["signal"] = -returncode
    if usage is not None:
        out["cpu_seconds"] = usage.cpu_ns / 1e9
        out["peak_mem"] = usage.peak_mem
    return out


def exited(
    code: int | None,
    how: str,
    returncode: int | None,
    result: dict[str, Any],
    *,
    usage: Usage | None,
    mem: int,
    fault: str,
) -> Outcome:
    """The outcome of a job whose processes ended by themselves (no stop asked): FAILED when the
    kernel's OOM killer ended a process of it, whatever its exit says; else SUCCEEDED on 0,
    FAILED otherwise, with `how` it exited and the `fault` of its GPUs, if one, as its detail.
    `code`, `how`: its exit as run_types.describe_exit tells it; `mem`: its --mem (0: none asked)."""
    if usage is not None and usage.oom_kills:
        return Outcome(JobState.FAILED, code, f"{out_of_memory(usage, mem)}; {how}", result)
    state = JobState.SUCCEEDED if returncode == 0 else JobState.FAILED
    if fault:
        how = f"{how}; {fault}"
    return Outcome(state, code, "" if returncode == 0 else how, result)


def out_of_memory(usage: Usage, mem: int) -> str:
    """The sentence of a job the kernel's OOM killer ended a process of, past its --mem."""
    mib = 2**20
    used, asked = usage.peak_mem / mib, mem / mib
    limit = f"its --mem of {asked:.0f} MiB" if asked else "no --mem asked (the machine ran out)"
    killed = usage.oom_kills
    return f"out of memory: used {used:.0f} MiB, {limit}; the kernel killed {killed} of its processes"
