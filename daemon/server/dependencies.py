"""The server's half of job dependencies (`--after`, daemon/after.py): it decides when a job that
waits for others joins its queue, or is cancelled because it never can.

A waiting job is held in its queue's `waiting` set with no stream entry, so no worker sees it.
Each job it waits for has a `dependents` set naming it (written at enqueue, before the job is
judged once). When a job ends, its terminal event (terminal_events.py) brings its dependents
here, and each is judged again: every dependency met, it joins its queue (ready.lua); one that
can no longer be met, it is cancelled with the reason. At the server's start every waiting job of
every queue is judged once, for the ends the server did not see while it was down (or that Redis
lost with a restart). Judging is idempotent (ready.lua moves a job once; a cancelled job stays
so), so two servers, or an event seen twice, do no harm. No polling: events and the start.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from redis.exceptions import RedisError

from daemon import after
from daemon.errors import JobNotFound, NotReplicated
from daemon.job import JobState
from daemon.queue.job_queue import JobQueue

log = logging.getLogger(__name__)


class Dependencies:
    """Judges the jobs that wait for others. `ended(job_id)` from the events reader, `run()` as a
    task of the server (it judges every waiting job once first)."""

    def __init__(self, queue: JobQueue) -> None:
        self.queue = queue
        self._ended: asyncio.Queue[str] = asyncio.Queue()

    def ended(self, job_id: str) -> None:
        """A job ended (its terminal event): its dependents are judged soon, in order."""
        self._ended.put_nowait(job_id)

    async def run(self) -> None:
        await self._judge_all()
        while True:
            job_id = await self._ended.get()
            try:
                for dependent in await self.queue.dependents(job_id):
                    await judge(self.queue, dependent)
            except (RedisError, NotReplicated) as exc:  # judged again at the next start, or end
                log.warning("could not judge the jobs waiting for %s (%s)", job_id, exc)

    async def _judge_all(self) -> None:
        try:
            for q in await self.queue.queues():
                for job_id in await self.queue.waiting(q):
                    await judge(self.queue, job_id)
        except (RedisError, NotReplicated) as exc:
            log.warning("could not judge the jobs waiting for others at start (%s)", exc)


async def weigh(queue: JobQueue, deps: Sequence[str]) -> tuple[str, str]:
    """after.verdict of dependencies `deps` ("JOB:how" each) as their jobs stand now."""
    states: list[JobState | None] = []
    for dep in deps:
        try:
            states.append((await queue.get(after.split(dep)[0])).state)
        except JobNotFound:
            states.append(None)  # gone: past retention
    return after.verdict(deps, states)


async def judge(queue: JobQueue, job_id: str) -> str:
    """Let `job_id` join its queue, cancel it, or leave it waiting, as its dependencies say:
    'ready', 'never' or 'wait' (after.verdict), or 'gone' when it is not waiting any more."""
    try:
        info = await queue.get(job_id)
    except JobNotFound:
        return "gone"
    deps = await queue.dependencies(job_id)
    if info.state is not JobState.QUEUED or not deps:
        return "gone"
    verdict, why = await weigh(queue, deps)
    if verdict == "ready":
        await queue.ready(job_id)
    elif verdict == "never":
        await queue.cancel(job_id, detail=f"cancelled: {why}")
    return verdict
