"""The server's half of job dependencies (`--after`, daemon/after.py): it decides when a job that
waits for others joins its queue, or is cancelled because it never can.

A waiting job is held in its queue's `waiting` set with no stream entry, so no worker sees it;
what it waits for is on its own record, written by the script that enqueued it (so no crash of
a server leaves a held job with nothing to say why). Two things bring it to be judged:

- the end of a job it waits for: each job it waits for has a `dependents` set naming it (noted
  right after its enqueue), and that job's terminal event (terminal_events.py) brings its
  dependents here at once;
- a sweep of every queue's held jobs, at the server's start and every `sweep_every` seconds after
  (Slurm re-checks dependencies at every scheduling pass): the ends this server did not see (it
  was down, Redis lost them with a restart), a note that never happened (the server died before
  it), a judge that Redis refused (a failover, its memory limit) are all made good by the next.

Judged, a job whose dependencies are all met joins its queue (ready.lua; in an array with a
window, it takes its turn for a place in it); one that can no longer be met is cancelled with the
reason. Judging is idempotent (ready.lua moves a job once; a cancelled job stays so), so two
servers, an event seen twice, or a sweep beside an event do no harm.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable, Sequence

from redis.exceptions import RedisError

from daemon import after
from daemon.errors import NotReplicated
from daemon.job import JobState
from daemon.queue.job_queue import JobQueue

log = logging.getLogger(__name__)

SWEEP_EVERY = 5.0  # seconds between two sweeps of every held job, at most
MOVES_AT_ONCE = 500  # jobs let in or cancelled together, in the round trips of one batch


class Dependencies:
    """Judges the jobs that wait for others. `ended(job_id)` from the events reader, `run()` as a
    task of the server (it sweeps every held job at once, then every `sweep_every` seconds)."""

    def __init__(self, queue: JobQueue, sweep_every: float = SWEEP_EVERY) -> None:
        self.queue = queue
        self.sweep_every = sweep_every
        self._ended: asyncio.Queue[str] = asyncio.Queue()

    def ended(self, job_id: str) -> None:
        """A job ended (its terminal event): its dependents are judged soon, in order."""
        self._ended.put_nowait(job_id)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._judging(self.sweep(), "the jobs waiting for others")
            next_sweep = loop.time() + self.sweep_every
            while (left := next_sweep - loop.time()) > 0:
                try:
                    job_id = await asyncio.wait_for(self._ended.get(), left)
                except TimeoutError:
                    break
                await self._judging(self._dependents_of(job_id), f"the jobs waiting for {job_id}")

    async def _dependents_of(self, job_id: str) -> None:
        await judge(self.queue, await self.queue.dependents(job_id))

    async def _judging(self, judging: Awaitable[None], what: str) -> None:
        """One judging, whose failure (Redis away or full, or a record it cannot read: a bug) is
        said and left to the next sweep: the sweep is what no held job can miss, so nothing may
        end it."""
        try:
            await judging
        except (RedisError, NotReplicated) as exc:
            log.warning(
                "could not judge %s (%s); the next sweep will, in %g s at most", what, exc, self.sweep_every
            )
        except Exception:  # said in full (a bug); the next sweep goes on
            log.exception("judging %s failed; the next sweep will try again", what)

    async def sweep(self) -> None:
        """Judge every job of every queue held for others whose dependencies were not found met."""
        for q in await self.queue.queues():
            await judge_held(self.queue, await self.queue.held_for_others(q))


async def weigh(queue: JobQueue, deps: Sequence[str]) -> tuple[str, str]:
    """after.verdict of dependencies `deps` ("JOB:how" each) as their jobs stand now."""
    states = await queue.states(after.split(dep)[0] for dep in deps)
    return after.verdict(deps, [states[after.split(dep)[0]] for dep in deps])


async def judge(queue: JobQueue, job_ids: Iterable[str]) -> None:
    """Judge each of `job_ids` that is held for others (a job that is not is left as it is)."""
    ids = list(job_ids)
    if ids:
        records = await queue.held_records(ids)
        await judge_held(
            queue, [(i, unmet) for i, (state, unmet) in records.items() if state is JobState.QUEUED]
        )


async def judge_held(queue: JobQueue, held: Sequence[tuple[str, Sequence[str]]]) -> None:
    """Judge each held job (id, what it waits for and was not found met yet): cancel it when one
    can no longer be met; else record those met now, and let it join its queue once all are
    (ready.lua). The states of the jobs waited for are read once for all of them."""
    if not held:
        return
    states = await queue.states(after.split(dep)[0] for _, deps in held for dep in deps)
    moves: list[Awaitable[object]] = []
    for job_id, deps in held:
        got = [states[after.split(dep)[0]] for dep in deps]
        verdict, why = after.verdict(deps, got)
        met = after.met(deps, got)
        if verdict == "never":
            moves.append(queue.cancel(job_id, detail=f"cancelled: {why}"))
        elif verdict == "ready" or met:
            moves.append(queue.ready(job_id, met, all_met=verdict == "ready"))
    for i in range(0, len(moves), MOVES_AT_ONCE):  # calls made together share round trips
        for answer in await asyncio.gather(*moves[i : i + MOVES_AT_ONCE], return_exceptions=True):
            if isinstance(answer, BaseException):
                raise answer  # (the rest were made, or refused alike: the next sweep makes them)
