"""One watch per Pool over every job it waits for: a single WaitJobs request, opened again with
the new set whenever jobs are added, instead of a stream per job.

The server streams each job as it ends (one that had ended already, at once), so a job that ends
between one request and the next is told by the next. Each ended job's record goes to `ended`.
A connection that fails is opened again (the pool's other servers first, `Pool.client`); after
RETRIES failures in a row the jobs still waited for fail with the error (their jobs run on, and
`pool.job(id)` waits for them again).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from daemon.aio import cancel_and_wait
from daemon.client.pool_client import ClientError, PoolClient
from daemon.job import TERMINAL_STATES
from protocol import JobEnded, Waited, WaitJobs

log = logging.getLogger(__name__)

RETRIES = 3
RETRY_SECONDS = 0.5


class Watch:
    """Runs on the API's loop: every method is called there."""

    def __init__(
        self,
        client: Callable[[], Awaitable[PoolClient]],
        ended: Callable[[dict[str, Any]], None],
        failed: Callable[[str, BaseException], None],
    ) -> None:
        self._client = client
        self._ended = ended
        self._failed = failed
        self._ids: set[str] = set()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def add(self, job_ids: list[str]) -> None:
        """Wait for these jobs too."""
        self._ids.update(job_ids)
        self._changed.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="gpupool-watch")

    def drop(self, job_id: str) -> None:
        """Wait no more for this job (cancelled here); the next request leaves it out."""
        self._ids.discard(job_id)

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)

    async def _run(self) -> None:
        failures = 0
        while self._ids:
            self._changed.clear()
            waiting = asyncio.create_task(self._wait(sorted(self._ids)), name="gpupool-wait-jobs")
            changed = asyncio.create_task(self._changed.wait())
            try:
                await asyncio.wait({waiting, changed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                await cancel_and_wait(changed)
                if not waiting.done():
                    await cancel_and_wait(waiting)
            if waiting.cancelled() or waiting.exception() is None:
                failures = 0
                continue
            error = waiting.exception()
            assert error is not None
            failures += 1
            if not isinstance(error, ClientError) or failures > RETRIES:
                for job_id in list(self._ids):
                    self._failed(job_id, error)
                self._ids.clear()
                return
            log.warning("waiting for jobs failed (%s); asking again", error)
            await asyncio.sleep(RETRY_SECONDS * failures)

    async def _wait(self, job_ids: list[str]) -> None:
        client = await self._client()
        async for item in client.stream(WaitJobs(job_ids, None)):
            ended = (
                [item.job] if isinstance(item, JobEnded) else item.jobs if isinstance(item, Waited) else []
            )
            for job in ended:  # the final reply holds them all again: each is told once
                if job["id"] in self._ids and job["state"] in TERMINAL_STATES:
                    self._ids.discard(job["id"])
                    self._ended(job)
