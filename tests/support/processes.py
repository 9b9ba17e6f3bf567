"""A child process ended the way every test and bench ends one: asked first, then made to."""

from __future__ import annotations

import subprocess
from typing import Any

KILLED_LIMIT = 10.0  # seconds a SIGKILLed process has to be reaped; past it, a test fails, not hangs


def terminate(proc: subprocess.Popen[Any], grace: float) -> None:
    """End `proc`: SIGTERM, so that it stops as it would under systemd or Slurm, then SIGKILL if it
    has not exited within `grace` seconds; return once it is reaped."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(KILLED_LIMIT)
