"""The worker under the faults a review found (issue 12), each with a real redis-server and real
processes: an idle Redis, a Redis that answers late, a Redis that restarts, a Redis at its memory
limit. Each test's docstring names the item it covers."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from daemon.embedded_redis import EmbeddedRedis
from daemon.job import JobState
from daemon.queue import JobQueue
from tests.workers import running_worker, sh, wait_state


async def test_an_idle_worker_keeps_waiting_without_timeouts(
    redis_server: EmbeddedRedis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Item 1: a worker waiting for work blocked in XREAD for as long as the client's socket
    timeout, so on a healthy, idle Redis its reads timed out, were retried by redis-py, and ended in
    "claiming failed (Timeout reading ...)" with a growing back-off. Here the client's timeout is
    short, so the idle wait outlasts it many times over; a job enqueued afterwards still starts."""
    client = redis_server.client(socket_timeout=0.2)
    queue = JobQueue(client, lease_seconds=30)
    try:
        with caplog.at_level(logging.WARNING):
            async with running_worker(queue, tmp_path / "w"):
                await asyncio.sleep(3.5)  # > 11 socket timeouts (redis-py's retries included)
                job_id, _ = await queue.enqueue(sh("true"))
                await wait_state(queue, job_id, JobState.SUCCEEDED, timeout=10)
    finally:
        await client.aclose()
    assert not [r for r in caplog.records if "failed" in r.getMessage()], caplog.text
