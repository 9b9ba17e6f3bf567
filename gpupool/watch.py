"""One watch per process and pool address over every job any of its Pools waits for: at most one
blocking WaitJobs request at a time, so that many Pools (notebooks, submitit's and Hydra's cached
pools) hold one of the user's few blocking reads (the server's MAX_BLOCKING_PER_USER), not one
each.

The server streams each job as it ends (one that had ended already, at once), so a job that ends
between one request and the next is told by the next. Each ended job's record goes to the Pools
that wait for it. More ids than one request may hold (the server's MAX_IDS) are waited for in
parts, in turn, each part for at most ROTATE_SECONDS.

The jobs run on in the pool whatever happens to the connection: a server restarting, or a network
that drops for a while, is waited out (the request made again after a back-off that grows to
MAX_BACKOFF_SECONDS) for as long as a Pool waits for a job. A job fails here only when the server
says it is not there or not ours to wait on (NOT_FOUND, PERMISSION_DENIED), and only that job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from daemon.aio import cancel_and_wait
from daemon.client.pool_client import ClientError, PoolClient
from daemon.ctl.link import Link
from daemon.job import TERMINAL_STATES
from protocol import ErrorCode, JobDetail, JobEnded, ShowJob, Waited, WaitJobs

log = logging.getLogger(__name__)

MAX_IDS = 10_000  # the server's (daemon/server/handlers.py MAX_IDS): ids in one request
ROTATE_SECONDS = 5.0  # how long one part is waited for when the ids are more than one request holds
FIRST_BACKOFF_SECONDS = 0.2
MAX_BACKOFF_SECONDS = 2.0
LOG_EVERY_SECONDS = 30.0  # a connection that stays down is logged this often, not at every try
REFUSALS = (ErrorCode.NOT_FOUND, ErrorCode.PERMISSION_DENIED)  # about a job: it fails, alone


class Waiter(Protocol):
    """A Pool, as the watch sees it: told of its jobs' ends (on the API's loop)."""

    def _ended(self, record: dict[str, Any]) -> None: ...

    def _failed(self, job_id: str, error: BaseException) -> None: ...


_watches: dict[tuple[str, str], Watch] = {}  # by (server, user): this process's, on the loop


def watch_for(link: Link) -> Watch:
    """The process's watch over the jobs of `link`'s pool and user (on the API's loop)."""
    key = (link.server, link.user)
    if (watch := _watches.get(key)) is None:
        watch = _watches[key] = Watch(link)
    return watch


class Watch:
    """Runs on the API's loop: every method is called there. It has a connection of its own,
    opened while it waits for jobs and closed when it waits for none."""

    def __init__(self, link: Link) -> None:
        self._link = link
        self._client: PoolClient | None = None
        self._ids: dict[str, set[Waiter]] = {}  # job id -> the Pools waiting for it
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.requests = 0  # WaitJobs requests made (a test counts them)

    def add(self, job_ids: list[str], waiter: Waiter) -> None:
        """`waiter` waits for these jobs too."""
        for job_id in job_ids:
            self._ids.setdefault(job_id, set()).add(waiter)
        self._changed.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="gpupool-watch")

    def drop(self, job_id: str, waiter: Waiter) -> None:
        """`waiter` waits no more for this job; the next request leaves it out if none does."""
        if (waiters := self._ids.get(job_id)) is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._ids[job_id]
                self._changed.set()  # the request is made again without it (or ends: none left)

    async def _run(self) -> None:
        backoff = FIRST_BACKOFF_SECONDS
        logged = 0.0
        part = 0
        try:
            while self._ids:
                self._changed.clear()
                ids = sorted(self._ids)
                parts = [ids[i : i + MAX_IDS] for i in range(0, len(ids), MAX_IDS)]
                part %= len(parts)
                limit = ROTATE_SECONDS if len(parts) > 1 else None
                try:
                    if await self._wait_or_change(parts[part], limit):
                        part += 1
                    backoff = FIRST_BACKOFF_SECONDS
                    continue
                except ClientError as error:
                    if error.code in REFUSALS:
                        await self._refused(parts[part], error)
                        continue
                    if time.monotonic() - logged > LOG_EVERY_SECONDS:
                        log.warning(
                            "waiting for jobs failed (%s); asking again until the pool answers", error
                        )
                        logged = time.monotonic()
                    await self._close_client()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
        except Exception as fault:  # noqa: BLE001 - a fault of ours: every job waited for is told
            for job_id in list(self._ids):
                for waiter in self._ids.pop(job_id):
                    waiter._failed(job_id, fault)
        finally:
            await self._close_client()
        if self._ids:  # added while the connection closed: `add` saw this task not yet done
            self._task = asyncio.create_task(self._run(), name="gpupool-watch")

    async def _wait_or_change(self, job_ids: list[str], limit: float | None) -> bool:
        """Wait for `job_ids` until the set waited for changes; True when the request ended of
        itself (its time was up, or all its jobs ended)."""
        waiting = asyncio.create_task(self._wait(job_ids, limit), name="gpupool-wait-jobs")
        changed = asyncio.create_task(self._changed.wait())
        try:
            await asyncio.wait({waiting, changed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(changed)
            if not waiting.done():
                await cancel_and_wait(waiting)
        if waiting.cancelled():
            return False
        waiting.result()  # raises its error
        return True

    async def _wait(self, job_ids: list[str], limit: float | None) -> None:
        client = await self._connected()
        self.requests += 1
        async for item in client.stream(WaitJobs(job_ids, limit)):
            ended = (
                [item.job] if isinstance(item, JobEnded) else item.jobs if isinstance(item, Waited) else []
            )
            for job in ended:  # the final reply holds them all again: each is told once
                if job["state"] in TERMINAL_STATES:
                    for waiter in self._ids.pop(job["id"], ()):
                        waiter._ended(job)

    async def _refused(self, job_ids: list[str], error: ClientError) -> None:
        """The server refused a wait on some of `job_ids`: those it refuses alone fail."""
        client = await self._connected()
        for job_id in job_ids:
            try:
                await client.call(ShowJob(job_id), JobDetail)
            except ClientError as why:
                if why.code not in REFUSALS:
                    raise
                for waiter in self._ids.pop(job_id, ()):
                    waiter._failed(job_id, why)

    async def _connected(self) -> PoolClient:
        if self._client is None or self._client.closed is not None:
            await self._close_client()
            client = self._link.client()
            await client.connect()
            self._client = client
        return self._client

    async def _close_client(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()
