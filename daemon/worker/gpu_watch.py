"""What the worker does with each reading of its GPUs for the attempts that hold them: keep each
one's usage summary (gpu_usage.py), apply the idle-GPU policy (idle_gpus.py), and put the summary
into the attempt's outcome at its end.

An attempt's summary and idle clock live on its record (attempt.HeldAttempt), made when it starts
on GPUs and dropped with it; readings reach them in the event loop (gpu_readings.py), so nothing
here locks. Recording the idle flag is one fenced script call (queue/lua/idle_gpu.lua), made in a
task of its own: a Redis that does not answer costs the flag, never a reading or the job.

The order of what is written is what a reader relies on. An attempt's records are written one
after the other (the flag, then what the policy did), and its end's record (its outcome or its
hand-back, and with it the notification) waits for the last (`recorded`): whoever reads how a
job ended finds the idle record that explains it. The policy stops a job only if nothing else has
(`Run.stopping`: its user's cancel, a drain, a GPU fault, its own end): an end that was another's
is never recorded as the policy's; the flag stays.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

from redis.exceptions import RedisError

from daemon.errors import NotReplicated
from daemon.metrics.worker import GpuSample, WorkerMetrics
from daemon.queue.job_queue import JobQueue
from daemon.worker.attempt import HeldAttempt, Phase
from daemon.worker.gpu_usage import GpuUsage
from daemon.worker.idle_gpus import Act, IdlePolicy
from daemon.worker.run_types import Ending, RunResult

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[None]"]

# The longest an attempt's end waits for its idle record to be written: one script call, which a
# Redis that does not answer may hold; the end is recorded then anyway (the record is lost).
RECORD_WAIT = 5.0


class GpuWatch:
    """The worker's attempts' GPU summaries and idle clocks, fed by `read`."""

    def __init__(self, queue: JobQueue, policy: IdlePolicy, spawn: Spawn) -> None:
        self.queue = queue
        self.policy = policy
        self._spawn = spawn

    def begin(self, held: HeldAttempt) -> None:
        """The attempt starts on its GPUs (none: nothing to watch)."""
        if held.run is not None and held.run.gpus:
            held.usage = GpuUsage((g.index, g.uuid) for g in held.run.gpus)
            held.idle = self.policy.watch(held.lease.spec.queue)

    def read(self, held: Iterable[HeldAttempt], samples: Sequence[GpuSample], at: float) -> None:
        """One reading of the worker's GPUs, taken at `at` (time.time())."""
        utilization = {s.uuid: s.utilization for s in samples}
        for h in held:
            if h.usage is None or h.phase is not Phase.RUNNING or h.run is None or h.run.exited:
                continue
            h.usage.add(samples, at)
            if h.idle is not None:
                act = h.idle.observe([utilization.get(uuid) for uuid in sorted(h.usage.uuids)], at)
                if act is not None:
                    self._idle(h, act, at)

    def _idle(self, held: HeldAttempt, act: Act, at: float) -> None:
        assert held.run is not None
        assert held.idle is not None
        lease, run, minutes = held.lease, held.run, held.idle.idle_minutes(at)
        idle = f"{minutes * 60:.0f} s" if minutes < 1 else f"{minutes:.1f} min"
        seen = f"its GPUs were below {self.policy.util:g} % for {idle}"
        if act is Act.FLAG:
            action = held.idle.action
            then = "requeued" if action is Act.REQUEUE else "cancelled" if action is Act.CANCEL else ""
            later = f"; it is {then} after {self.policy.grace_minutes:g} min more" if then else ""
            run.note(f"{seen} (idle_gpu_minutes): flagged as idle{later}")
        elif run.stopping:  # its end is another's (or its own): the flag stays as it was
            log.info("job %s attempt %d: %s, but it is ending already", lease.job_id, lease.attempt, seen)
            return
        elif act is Act.REQUEUE:
            run.hand_back(why=f"{seen}: its queue requeues jobs that leave GPUs idle", by_policy=True)
        else:
            run.note(f"{seen}: its queue cancels jobs that leave GPUs idle")
            run.cancel()
        log.warning("job %s attempt %d: %s (%s)", lease.job_id, lease.attempt, seen, act.value)
        record = {
            "attempt": lease.attempt,
            "since": held.idle.since,
            "minutes": round(minutes, 2),
            "util_below": self.policy.util,
            "action": None if act is Act.FLAG else act.value,
        }
        held.idle_record = self._spawn(
            self._record(held, record, held.idle_record), f"idle flag of {lease.job_id}"
        )

    async def _record(
        self, held: HeldAttempt, record: dict[str, Any], after: asyncio.Task[None] | None
    ) -> None:
        if after is not None:  # the flag before what the policy did: the last written stays
            await asyncio.wait([after])
        try:
            if not await self.queue.flag_idle_gpu(held.lease, record):
                log.info("job %s: idle flag not recorded: the attempt no longer holds it", held.lease.job_id)
        except (RedisError, NotReplicated) as exc:
            log.warning("job %s: could not record its idle flag: %s", held.lease.job_id, exc)

    @staticmethod
    async def recorded(held: HeldAttempt) -> None:
        """Wait (at most RECORD_WAIT) until the attempt's idle record is written, before its end
        is: a reader of that end finds the record that explains it."""
        if held.idle_record is not None:
            await asyncio.wait([held.idle_record], timeout=RECORD_WAIT)

    @staticmethod
    def summarised(held: HeldAttempt, result: RunResult, metrics: WorkerMetrics) -> RunResult:
        """`result` with the attempt's GPU usage (`gpu_usage`), in its outcome's record too where
        it has one, its efficiency observed in `metrics`; as it was without GPUs, readings, or an
        end to record (a lost lease). A hand-back carries it as well: the attempt's GPU-hours are
        accounted, so is what they did."""
        if held.usage is None or result.ending is Ending.LOST or (usage := held.usage.summary()) is None:
            return result
        if usage["efficiency"] is not None:
            metrics.job_efficiency(held.lease.spec.queue, usage["efficiency"])
        outcome = result.outcome
        if outcome is not None:
            outcome = dataclasses.replace(outcome, result={**outcome.result, "gpu_usage": usage})
        return dataclasses.replace(result, outcome=outcome, gpu_usage=usage)
