"""When a worker leaves by itself: after `worker_idle_exit` seconds with no job, or before
`worker_max_lifetime` seconds from its start (a pilot worker: a batch job on a Slurm or PBS
cluster, whose walltime ends it whatever it is doing).

A pilot's allocation costs its user while it waits, and ends hard at its walltime. So an idle
worker gives it back (idle: no attempt held, none running, none claimed; the clock restarts with
each attempt), and a worker with an end never holds a job past it:

- it claims only jobs that end, their time limit and stop grace counted from the claim, before
  its drain would have to stop them (`claim_lifetime`, which claim.lua reads as `lifetime_ms`); a job
  without a time limit could run past any end, so a pilot never claims one: it stays queued for
  the workers without an end;
- each job it runs is stopped in time for its own stop grace (`stop_in_time`): its stop signal
  goes its grace and HAND_BACK_SECONDS (daemon/config.py) before the end, SIGKILL HAND_BACK_SECONDS
  before it, and the attempt is handed back in that last moment. A job still running then started
  later than its claim (its code or data took a while to come): it goes back to the front of its
  queue, and runs again elsewhere, from its checkpoint;
- it begins its drain (`drain_in`) `drain_timeout + kill_grace + HAND_BACK_SECONDS` before its
  end: it claims nothing more, lets what runs finish, and hands back the rest, as on SIGTERM
  (Worker.stop(): drain, hand back, unregister). The process then exits 0: the batch job ends
  well.

The end is counted from the process's start (its batch job's, as the pilot script execs poold),
not from the worker's: the imports and the connections to Redis and S3 are part of the walltime.
Waits run on CLOCK_BOOTTIME, in steps of at most LOOK_AGAIN, so a suspended machine does not make
the worker overstay. Its leave-by time goes into its registration (daemon/queue/registry.py),
for `poolctl workers`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from daemon.config import HAND_BACK_SECONDS, Config
from daemon.errors import GpupoolError
from daemon.worker.attempt import boottime

log = logging.getLogger(__name__)

LOOK_AGAIN = 30.0  # longest single wait: the clocks are compared again after it


@dataclass(frozen=True, slots=True)
class Lifetime:
    """A worker's end: `idle_exit` seconds without a job (0: never), and `max_lifetime` seconds after
    `started` (Unix time of the process's start; 0: no end)."""

    idle_exit: float
    max_lifetime: float
    drain_timeout: float
    kill_grace: float
    started: float

    @classmethod
    def of(cls, config: Config, started: float | None = None) -> Lifetime | None:
        """The configuration's lifetime (None when it sets neither option); GpupoolError when the
        drain could not fit into the lifetime."""
        if not (config.worker_idle_exit or config.worker_max_lifetime):
            return None
        lifetime = cls(
            config.worker_idle_exit,
            config.worker_max_lifetime,
            config.drain_timeout,
            config.kill_grace,
            psutil.Process().create_time() if started is None else started,
        )
        leaving = config.leaving_seconds
        if config.worker_max_lifetime and config.worker_max_lifetime <= leaving:
            raise GpupoolError(
                f"worker_max_lifetime {config.worker_max_lifetime:g} s leaves no time to work: it must "
                f"exceed drain_timeout + kill_grace + {HAND_BACK_SECONDS:g} s to hand back ({leaving:g} s), "
                "the time the worker takes to leave"
            )
        return lifetime

    @property
    def leave_by(self) -> float:
        """Unix time by which the worker has left (0.0: no end)."""
        return self.started + self.max_lifetime if self.max_lifetime else 0.0

    def _until(self, unix: float) -> float:
        """Seconds from now until `unix` (Unix time)."""
        return unix - time.time()

    def drain_in(self) -> float | None:
        """Seconds until the drain must begin (None: no end)."""
        if not self.max_lifetime:
            return None
        return self._until(self.leave_by - self.drain_timeout - self.kill_grace - HAND_BACK_SECONDS)

    def claim_lifetime(self) -> float | None:
        """What a claim must know (claims.Capacity's `lifetime`): the seconds until this worker's
        drain ends and it stops what still runs. A job whose time limit and stop grace fit in them
        has ended by then if it starts at once, however long it runs (claim.lua passes over the
        others, and every job without a time limit); None for a worker with no end."""
        if not self.max_lifetime:
            return None
        drain_ends = self.leave_by - self.kill_grace - HAND_BACK_SECONDS
        return max(0.001, self._until(drain_ends))

    def stop_in(self, grace: float) -> float | None:
        """Seconds until a job whose stop grace is `grace` must be sent its stop signal, so that it
        is gone, and handed back, by the end (None: no end)."""
        if not self.max_lifetime:
            return None
        return self._until(self.leave_by - grace - HAND_BACK_SECONDS)

    async def stop_in_time(self, job_id: str, grace: float, stop: Callable[[str], None]) -> None:
        """Wait, while job `job_id`, whose stop grace is `grace`, runs, until it must be stopped
        (`stop_in`), then `stop` it (a hand-back), saying why; at once if that time has passed. The
        caller cancels this once the job has ended. A worker with no end never stops it."""
        left = self.stop_in(grace)
        if left is None:
            return
        at = boottime() + left  # on the boot clock, fixed now: a suspend does not move it
        while True:
            now = boottime()
            if now >= at:
                break
            await asyncio.sleep(min(LOOK_AGAIN, at - now))
        log.info("job %s: stopping it, to hand it back before this worker's end", job_id)
        stop(
            f"this worker must have left by {time.strftime('%H:%M:%S', time.localtime(self.leave_by))} "
            f"(worker_max_lifetime {self.max_lifetime:g} s), and the job's stop grace is {grace:g} s"
        )

    async def due(self, idle_for: Callable[[], float]) -> str:
        """Wait until the worker must leave; why, in a sentence. `idle_for` says for how long the
        worker has held no attempt (0.0 while it holds one)."""
        start = boottime()
        # the drain's start on the boot clock, fixed now: a suspend does not move it
        drain_at = None if (d := self.drain_in()) is None else start + d
        while True:
            now = boottime()
            waits = [LOOK_AGAIN]
            if drain_at is not None:
                if now >= drain_at:
                    return (
                        f"its lifetime ends at {time.strftime('%H:%M:%S', time.localtime(self.leave_by))} "
                        f"(worker_max_lifetime {self.max_lifetime:g} s): draining for up to "
                        f"{self.drain_timeout:g} s and handing back what still runs"
                    )
                waits.append(drain_at - now)
            if self.idle_exit:
                quiet = idle_for()
                if quiet >= self.idle_exit:
                    return f"no job for {quiet:.0f} s (worker_idle_exit {self.idle_exit:g} s)"
                # busy: look again in idle_exit; idle since a moment: when that moment is idle_exit old
                waits.append(self.idle_exit - quiet)
            await asyncio.sleep(max(0.0, min(waits)))
