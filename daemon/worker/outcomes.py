"""How a worker records the end of an attempt: its outcome, or its hand-back to the queue.

Each is one fenced script call (complete.lua, hand_back.lua): Redis decides whether the write still
counts, since only the lease's current holder may end an attempt (StaleAttempt when it passed on).
While Redis does not answer, the call is made again until it does (the heartbeat keeps renewing
the lease meanwhile, and both scripts are idempotent, so a call whose reply was lost is safe to
repeat). The worker gives up only when it is forced to stop, or on an error that another try
would not mend; then the lease expires and the reaper takes the attempt back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from redis.exceptions import RedisError

from daemon.errors import NotReplicated, StaleAttempt
from daemon.job import JobState, Lease
from daemon.queue.failures import transient
from daemon.queue.job_queue import JobQueue
from daemon.worker.run_types import Ending, RunResult

log = logging.getLogger(__name__)

RECORD_RETRY = 1.0  # longest pause between tries to record an outcome while Redis does not answer


class Outcomes:
    """Records attempts' ends on `queue`; `forced` set means stop retrying (a second signal)."""

    def __init__(self, queue: JobQueue, forced: asyncio.Event) -> None:
        self.queue = queue
        self.forced = forced

    async def report(self, lease: Lease, result: RunResult, linger: float = 0.0) -> None:
        """Record how the attempt ended: its outcome, or a hand-back when it has none (stopped by
        the worker); nothing when its lease was lost (the attempt is another's to end). An
        outcome may wait `linger` seconds for others to share its round trip (the fast path's
        Pipeliner, queue/fast_path.py)."""
        job, n = lease.job_id, lease.attempt
        if result.ending is Ending.LOST:
            log.warning("job %s attempt %d: killed, nothing recorded: the lease was lost", job, n)
        elif result.outcome is None:
            state = await self.hand_back(
                lease, by_policy=result.by_policy, gpu_usage=result.gpu_usage, why=result.why
            )
            if state is not None:
                log.info("job %s attempt %d: handed back (%s)", job, n, state)
        else:
            outcome = result.outcome
            state = await self._record(
                lease, "record the outcome", lambda: self.queue.complete(lease, outcome, linger=linger)
            )
            how = f"{outcome.state}{' (' + outcome.detail + ')' if outcome.detail else ''}"
            if state is None:
                log.warning("job %s attempt %d: ended %s, but that outcome was not recorded", job, n, how)
            elif state is JobState.QUEUED:
                log.info("job %s attempt %d: %s; queued again for a retry", job, n, how)
            else:
                log.info("job %s attempt %d: %s", job, n, how)

    async def hand_back(
        self,
        lease: Lease,
        *,
        by_policy: bool = False,
        gpu_usage: Mapping[str, Any] | None = None,
        why: str = "",
    ) -> JobState | None:
        """Put the attempt back at the front of its queue (hand_back.lua; `by_policy`: a loss
        towards max_attempts, `why` the job's detail meanwhile; `gpu_usage`: what its GPUs did,
        for its accounting); None if not recorded."""
        return await self._record(
            lease,
            "hand back",
            lambda: self.queue.hand_back(lease, by_policy=by_policy, gpu_usage=gpu_usage, why=why),
        )

    async def _record(
        self, lease: Lease, what: str, call: Callable[[], Awaitable[JobState]]
    ) -> JobState | None:
        job = lease.job_id
        delay, said = 0.1, False
        while True:
            try:
                return await call()
            except StaleAttempt as exc:
                log.warning("job %s: could not %s: %s", job, what, exc)
                return None
            except (RedisError, NotReplicated) as exc:  # complete runs again safely (by its lease)
                if self.forced.is_set() or not (isinstance(exc, NotReplicated) or transient(exc)):
                    log.error("job %s: could not %s (%s); its lease will expire", job, what, exc)
                    return None
                if not said:
                    log.warning("job %s: could not %s yet (%s); trying until Redis answers", job, what, exc)
                    said = True
                await asyncio.sleep(delay)  # a back-off between retries
                delay = min(delay * 2, RECORD_RETRY)
