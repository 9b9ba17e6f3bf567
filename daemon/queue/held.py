"""Jobs held for others (daemon/after.py): what each waits for and what the server's judge found
met, the dependents to tell of an end, arrays and their windows, and the judge's verdict
(ready.lua). The server decides (server/dependencies.py); these are its reads and its one write.
A mixin of JobQueue, which sets the attributes below.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

from daemon.job import JobState, queue_of
from daemon.queue import keys
from daemon.queue.connection import AnyRedis
from daemon.queue.reads import _s
from daemon.queue.scripts import Calls, ScriptBatch, Scripts


class HeldJobs:
    """The dependency and array calls of a JobQueue (which sets these attributes)."""

    redis: AnyRedis
    scripts: Scripts
    _call: Calls

    def batch(self, *, ack: bool = True) -> ScriptBatch:
        raise NotImplementedError  # JobQueue's

    async def note_dependents(self, jobs: Iterable[tuple[str, Sequence[str]]]) -> None:
        """Note each job (id, what it waits for: "JOB:how" each) in the `dependents` set of every
        job it waits for, so that their ends bring the server to judge it at once; one round trip
        for all. What a job waits for is on its own record from its enqueue (add_job): a note that
        never happened (the server died first) only leaves the judging to the server's sweep."""
        batch = self.batch(ack=False)
        for job_id, after in jobs:
            for dep in after:
                other = dep.rpartition(":")[0]
                batch.add(self.scripts.note_dependent, [keys.dependents(other), keys.job(other)], [job_id])
        await batch.execute()

    async def array_jobs(self, array_id: str) -> list[str]:
        """The jobs of array `array_id`, in their order ([] for an array the pool does not know)."""
        return [_s(cast(bytes, i)) for i in await self.redis.zrange(keys.array(array_id), 0, -1)]

    async def dependencies(self, job_id: str) -> tuple[str, ...]:
        """What a job waits for and was not found met yet ("JOB:how" each): its enqueue's record of
        what it waits for (add_job), less what the server's judge found met (ready.lua)."""
        return (await self.held_records([job_id]))[job_id][1]

    async def held_records(
        self, job_ids: Sequence[str]
    ) -> dict[str, tuple[JobState | None, tuple[str, ...]]]:
        """Each job's state (None: not in the pool) and the dependencies it was not found to have
        met yet, in one round trip; in enqueue order (so an array's jobs, judged ready together,
        take their turns for its window by index)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(keys.job(job_id), ["state", "after", "after_met", "seq"])
            records = await pipe.execute()
        out: list[tuple[int, str, JobState | None, tuple[str, ...]]] = []
        for job_id, (state, after, met, seq) in zip(job_ids, records, strict=True):
            done = set(_s(met or b"").split())
            unmet = tuple(d for d in _s(after or b"").split() if d not in done)
            out.append((int(seq or 0), job_id, JobState(_s(state)) if state else None, unmet))
        return {job_id: (state, unmet) for _, job_id, state, unmet in sorted(out)}

    async def held_for_others(self, queue: str, page: int = 500) -> list[tuple[str, tuple[str, ...]]]:
        """The jobs of `queue` held for others to end whose dependencies were not all found met
        (`depends`), each with those not met yet: what the server's sweep judges. A round trip
        per `page` jobs held, two with their records."""
        out: list[tuple[str, tuple[str, ...]]] = []
        start = 0
        while ids := [
            _s(cast(bytes, i)) for i in await self.redis.zrange(keys.depends(queue), start, start + page - 1)
        ]:
            for job_id, (state, unmet) in (await self.held_records(ids)).items():
                if state is JobState.QUEUED:
                    out.append((job_id, unmet))
            start += page
        return out

    async def states(self, job_ids: Iterable[str]) -> dict[str, JobState | None]:
        """The state of each job (None: not in the pool, or not any more), in one round trip."""
        ids = list(dict.fromkeys(job_ids))
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hget(keys.job(job_id), "state")
            got = await pipe.execute()
        return {
            job_id: JobState(_s(state)) if state else None for job_id, state in zip(ids, got, strict=True)
        }

    async def array_window(self, array_id: str) -> tuple[int, int]:
        """An array's jobs under way (let into its queue, not ended) and its window (0: none)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.scard(keys.array_active(array_id))
            pipe.zrange(keys.array(array_id), 0, 0)
            active, first = await pipe.execute()
        window = await self.redis.hget(keys.job(_s(first[0])), "window") if first else None
        return int(active), int(window or 0)

    async def dependents(self, job_id: str) -> list[str]:
        """The jobs that wait for `job_id` to end."""
        return sorted(_s(i) for i in await self.redis.smembers(keys.dependents(job_id)))

    async def waiting(self, queue: str) -> list[str]:
        """The jobs of `queue` held out of it: till the jobs they wait for end, or till their
        array's window has a place for them."""
        return [_s(cast(bytes, i)) for i in await self.redis.zrange(keys.waiting(queue), 0, -1)]

    async def ready(self, job_id: str, met: Sequence[str], *, all_met: bool = True) -> bool:
        """The judge of a job held for others (ready.lua): `met` (the dependencies found met, with
        those found before) is recorded on it, and with `all_met` it joins its queue, or its
        array's turn for a place in its window. True when it moved now."""
        joined = await self._call(
            self.scripts.ready,
            [keys.job(job_id)],
            [keys.queue_prefix(queue_of(job_id)), job_id, " ".join(met), 1 if all_met else 0],
            durable=True,
        )
        return bool(joined)
