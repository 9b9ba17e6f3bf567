"""submitit's parameter names, as gpupool understands them.

AutoExecutor hands the gpupool executor its shared parameters under their own names and those
prefixed `gpupool_` without the prefix (`slurm_*` ones go to Slurm's executor only, and never reach
this one). Each is mapped to an option of gpupool's `Pool.submit`, refused when running it as asked
is impossible here, or ignored with a warning, once per name and process, when gpupool has nothing
like it and the job runs correctly without it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

# gpupool's own, as `Pool.submit` takes them, set as `gpupool_queue=...` on an AutoExecutor. None
# is a name Slurm's executor uses: AutoExecutor takes an unprefixed name for the last executor
# that has it, and a shared one would move a Slurm user's unprefixed `partition=` onto gpupool.
GPUPOOL_PARAMETERS = frozenset({"queue", "gpu_mem", "priority", "retries", "stop_grace"})

# Shared names gpupool has no counterpart for; the job runs all the same, without that limit.
IGNORED = {
    "mem_gb": "gpupool does not limit a job's memory",
    "cpus_per_task": "gpupool does not limit a job's CPUs",
}

# Shared names gpupool honours: timeout_min, gpus_per_node and name are mapped (submit_options);
# a job's output is always one stream, as stderr_to_stdout asks; nodes and tasks_per_node only at 1.
HONOURED = frozenset({"name", "timeout_min", "gpus_per_node", "stderr_to_stdout", "nodes", "tasks_per_node"})

_warned: set[str] = set()


def checked(params: Mapping[str, Any]) -> dict[str, Any]:
    """`params` as given, after refusing those gpupool cannot honour and warning of those it
    ignores."""
    unknown = sorted(params.keys() - HONOURED - IGNORED.keys() - GPUPOOL_PARAMETERS)
    if unknown:
        known = ", ".join(sorted(HONOURED | IGNORED.keys() | GPUPOOL_PARAMETERS))
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)} for gpupool; known: {known}")
    for name in ("nodes", "tasks_per_node"):
        if params.get(name, 1) != 1:
            raise ValueError(
                f"{name}={params[name]}: gpupool's submitit executor runs each call as one task on one "
                f"machine; leave {name} at 1 (a multi-node gang is `poolctl enqueue --nodes N`)"
            )
    for name in sorted(params.keys() & IGNORED.keys() - _warned):
        _warned.add(name)
        # stacklevel: the line that called AutoExecutor.update_parameters
        warnings.warn(f"submitit's {name} is ignored on gpupool: {IGNORED[name]}", stacklevel=5)
    return dict(params)


def submit_options(params: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of gpupool's `Pool.submit` and `Pool.map` that `params` ask for."""
    options: dict[str, Any] = {}
    if "timeout_min" in params:
        options["timeout"] = 60 * params["timeout_min"]
    if "gpus_per_node" in params:
        options["gpus"] = params["gpus_per_node"]
    for name in ("name", *sorted(GPUPOOL_PARAMETERS)):
        if name in params:
            options[name] = params[name]
    return options
