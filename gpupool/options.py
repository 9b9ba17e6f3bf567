"""What a job asks of the pool besides its command: the keyword options of `submit`, `map`, `run`
and `executor`, checked here so a mistake is a sentence before anything is uploaded (the server
checks the whole spec again)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from daemon.ctl.enqueue_args import (
    ATTEMPTS_MAX,
    CPUS_MAX,
    GPUS_MAX,
    PRIORITY_MAX,
    STOP_GRACE_MAX,
    gpu_mem_size,
    job_mem_size,
)
from daemon.errors import GpupoolError
from gpupool.errors import BadArgument

ProjectChoice = bool | str | os.PathLike[str]
SIGNALS = ("TERM", "INT", "HUP", "USR1", "USR2", "QUIT")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """A job's options, as `poolctl enqueue`'s flags of the same names mean them. `project`: True
    runs the job in a copy of the project this process runs in (found from the working directory,
    as poolctl finds it), with its environment; a path, in that directory's project; False, in an
    empty scratch directory with the worker's own Python."""

    gpus: int = 0
    gpu_mem: int | str | None = None  # bytes, or a size as poolctl takes it: "20G"
    cpus: int = 0  # CPUs on the worker (0: the queue's default, else no limit)
    mem: int | str | None = None  # bytes of memory on the worker, or a size: "16G"
    queue: str | None = None
    timeout: float | None = None
    name: str | None = None
    env: Mapping[str, str] | None = None
    retries: int = 0
    priority: int = 0
    max_attempts: int = 3
    stop_signal: str = "TERM"
    stop_grace: float | None = None
    checkpoint_every: float | None = None
    after: Sequence[str] = ()
    wait_for_worker: bool = False
    project: ProjectChoice = True

    def __post_init__(self) -> None:
        _whole("gpus", self.gpus, 0, GPUS_MAX)
        _whole("cpus", self.cpus, 0, CPUS_MAX)
        _whole("retries", self.retries, 0, ATTEMPTS_MAX)
        _whole("priority", self.priority, 0, PRIORITY_MAX)
        _whole("max_attempts", self.max_attempts, 1, ATTEMPTS_MAX)
        _seconds("timeout", self.timeout)
        _seconds("checkpoint_every", self.checkpoint_every)
        _seconds("stop_grace", self.stop_grace, STOP_GRACE_MAX)
        if self.gpus and self.gpu_mem:
            raise BadArgument(
                "gpus and gpu_mem each ask for GPUs: give one (gpu_mem: memory on a shared GPU)"
            )
        if self.queue is not None and (not isinstance(self.queue, str) or not self.queue):
            raise BadArgument(f"queue={self.queue!r}: a queue's name, e.g. queue='default'")
        if self.name is not None and not isinstance(self.name, str):
            raise BadArgument(f"name={self.name!r}: a job's name is a string")
        if self.stop_signal not in SIGNALS:
            raise BadArgument(f"stop_signal={self.stop_signal!r}: one of {', '.join(SIGNALS)}")
        env = self.env or {}
        if not isinstance(env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise BadArgument("env: a mapping of variable names to string values")
        if isinstance(self.after, str) or not all(isinstance(a, str) for a in self.after):
            raise BadArgument(f"after={self.after!r}: a list of job ids, each JOB[:ok|:fail|:any]")
        if not isinstance(self.project, bool | str | os.PathLike):
            raise BadArgument(f"project={self.project!r}: True, False, or a directory")

    def replace(self, **changes: Any) -> Options:
        """These options with `changes` (each checked as the constructor checks it)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise BadArgument(f"no job option {unknown[0]!r}; the options: {', '.join(names())}")
        return dataclasses.replace(self, **changes)

    def gpu_mem_bytes(self) -> int:
        return _size("gpu_mem", self.gpu_mem, gpu_mem_size)

    def mem_bytes(self) -> int:
        """`mem`, in bytes: a MiB at least, as poolctl's --mem (mem=4096 is 4096 bytes, a job
        killed by its own limit at once: refused, saying to give a unit)."""
        return _size("mem", self.mem, job_mem_size)

    def spec(self, argv: list[str], default_name: str) -> dict[str, Any]:
        """The job spec for `argv` with these options (the project and inputs are added later)."""
        spec: dict[str, Any] = {
            "argv": argv,
            "queue": self.queue or "default",
            "name": self.name if self.name is not None else default_name,
            "env": dict(self.env or {}),
            "gpus": self.gpus,
            "wait_for_worker": self.wait_for_worker,
            "timeout": self.timeout,
            "retries": self.retries,
            "priority": self.priority,
            "checkpoint_every": self.checkpoint_every,
            "stop_signal": self.stop_signal,
            "stop_grace": self.stop_grace,
            "max_attempts": self.max_attempts,
            "cwd": None,
        }
        if gpu_mem := self.gpu_mem_bytes():  # sent only when asked for, as poolctl does
            spec["gpu_mem"] = gpu_mem
        if self.cpus:  # the same
            spec["cpus"] = self.cpus
        if mem := self.mem_bytes():  # the same
            spec["mem"] = mem
        if self.after:
            spec["after"] = list(self.after)
        return spec

    def project_dir(self) -> tuple[Path, bool] | None:
        """Where to look for the job's project, and whether that directory is one by itself (a
        path given); None for none (daemon/ctl/enqueue_spec.py `project_start` says the same)."""
        from daemon.ctl.project_root import maybe_within, real

        if self.project is False:
            return None
        if self.project is True:
            here = real(Path.cwd())
            return (here, False) if maybe_within(here, real(Path.home())) else None
        path = Path(self.project).expanduser()
        if not path.is_dir():
            raise BadArgument(f"project={str(self.project)!r}: no such directory")
        return real(path), True


def names() -> list[str]:
    return [f.name for f in dataclasses.fields(Options)]


def split(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The job options among `kwargs`, taken out of it (the rest are the function's)."""
    return {k: kwargs.pop(k) for k in names() if k in kwargs}


def _size(name: str, value: int | str | None, size: Callable[[str], int]) -> int:
    """Bytes of a size option (`gpu_mem`, `mem`): bytes, or a size as poolctl takes it (read by
    `size`, poolctl's reader of that option); 0: none."""
    if value is None or value == 0:
        return 0
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise BadArgument(f"{name}={value!r}: bytes, or a size such as '20G'")
    try:
        return size(str(value))
    except argparse.ArgumentTypeError as exc:
        raise BadArgument(f"{name}: {exc}") from None


def _whole(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadArgument(f"{name}={value!r}: a whole number from {lo} to {hi}")


def _seconds(name: str, value: object, most: float = math.inf) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= most:
        bound = "" if most == math.inf else f" (at most {most:g})"
        raise BadArgument(f"{name}={value!r}: seconds, a number above 0{bound}, or None")


__all__ = ["GpupoolError", "Options", "names", "split"]
