"""How a job's processes are signalled to stop: its stop signal (`--stop-signal`), then SIGKILL
after its grace (`--stop-grace`, else the worker's `kill_grace`), sent to its whole process group.

Apart from runner.py, which decides when a job stops and what its end records: this only says
which signal and how long, and sends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

from daemon.job import JobSpec


class StopSignals:
    """The stop signals of one job, whose first process leads its group (a new session), so that
    its pid is the group id and one `killpg` reaches every process it starts."""

    def __init__(self, spec: JobSpec, kill_grace: float) -> None:
        self.spec = spec
        self.kill_grace = kill_grace  # the worker's: a job's grace when it asked none of its own

    @property
    def stop_signal(self) -> signal.Signals:
        """The signal the job asked to be stopped with (`--stop-signal`; SIGTERM by default)."""
        return signal.Signals[f"SIG{self.spec.stop_signal}"]

    @property
    def stop_grace(self) -> float:
        """How long a stopping job has before SIGKILL: its own `--stop-grace`, else the worker's."""
        return self.spec.stop_grace or self.kill_grace

    async def terminate(self, pgid: int) -> None:
        """The stop signal, then SIGKILL after the grace."""
        self.send(pgid, self.stop_signal)
        await asyncio.sleep(self.stop_grace)
        self.send(pgid, signal.SIGKILL)

    @staticmethod
    def send(pgid: int, sig: signal.Signals) -> None:
        """`sig` to the group; one already gone, or out of reach, is no error."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
