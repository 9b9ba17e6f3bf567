"""The reaper (server side): takes back attempts whose lease went silent, and forgets dead workers.

A lease lives `worker_healthy_response_period` past its worker's last renewal, judged by Redis
server time inside the reclaim script, so clocks of different machines are never compared. A
reclaimed attempt's job goes to the front of its queue with attempt+1 and a new lease, which
fences the old holder. One pass is one round trip for every queue (queue.reclaim). Workers silent
for longer than `dead_worker_retention` are dropped from the registry (registry.prune).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from redis.exceptions import RedisError

from daemon.job import JobState
from daemon.queue import registry
from daemon.queue.job_queue import JobQueue

log = logging.getLogger(__name__)


async def run(
    queue: JobQueue,
    interval: float,
    on_reclaimed: Callable[[str, JobState], None] | None = None,
    worker_retention: float = 24 * 3600.0,
) -> None:
    """Reclaim expired leases every `interval` seconds until cancelled. Redis errors are logged and
    retried on the next pass: a reaper that stops would leave dead workers' jobs stuck."""
    while True:
        try:
            for job_id, state in await queue.reclaim():
                if on_reclaimed is not None:
                    on_reclaimed(job_id, state)
            for worker in await registry.prune(queue.redis, queue.scripts, worker_retention):
                log.info("worker %s: silent for over %g s, forgotten", worker, worker_retention)
        except RedisError as exc:
            log.warning("reaper pass failed (%s); retrying in %.1f s", exc, interval)
        await asyncio.sleep(interval)
