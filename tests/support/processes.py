"""A child process ended the way every test and bench ends one: asked first, then made to."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from typing import Any

KILLED_LIMIT = 10.0  # seconds a SIGKILLed process has to be reaped; past it, a test fails, not hangs


def terminate(proc: subprocess.Popen[Any], grace: float) -> None:
    """End `proc`: SIGTERM, so that it stops as it would under systemd or Slurm, then SIGKILL if it
    has not exited within `grace` seconds; return once it is reaped."""
    terminate_all([proc], grace)


def terminate_all(procs: Sequence[subprocess.Popen[Any]], grace: float) -> None:
    """End each of `procs` as terminate() ends one, but ask them all first (SIGTERM to every one),
    so that they stop side by side, as a cluster's daemons do; then, in order, give each `grace`
    seconds more to exit before SIGKILL. A process already ended is only reaped."""
    for proc in procs:
        proc.terminate()  # Popen sends nothing to a process it has seen exit
    for proc in procs:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(KILLED_LIMIT)
