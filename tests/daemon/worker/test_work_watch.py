"""How an idle worker waits for work (daemon/worker/work_watch.py), against a real redis-server:
its blocking read kept from one wait to the next, and its next claim left standing for an enqueue
through its JobQueue to send."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from daemon.job import JobState, Lease
from daemon.queue.job_queue import JobQueue
from daemon.worker.work_watch import WorkWatch
from tests.support.workers import running_worker, sh, wait_file, wait_state


async def _connections(redis: Redis) -> int:
    return int((await redis.info("stats"))["total_connections_received"])


async def test_an_idle_worker_keeps_its_connections_from_job_to_job(
    redis: Redis, queue: JobQueue, tmp_path: Path
) -> None:
    """Each job ends the worker's wait for work (a slot is free: it claims). Cancelling the
    blocking read that wait had sent made redis-py drop its connection, and the worker connected
    anew, three round trips, for every job; the read is now left for the next wait."""
    other = JobQueue(redis)  # the jobs come from elsewhere: no claim stands for them
    async with running_worker(queue, tmp_path / "w", slots=1, heartbeat_seconds=600):
        for _ in range(2):  # its connections made: the claim's, the read's, the completion's
            job_id, _ = await other.enqueue(sh("true"))
            await wait_state(other, job_id, JobState.SUCCEEDED)
            await asyncio.sleep(0.1)
        before = await _connections(redis)
        for _ in range(8):
            job_id, _ = await other.enqueue(sh("true"))
            await wait_state(other, job_id, JobState.SUCCEEDED)
            await asyncio.sleep(0.1)  # idle: it waits for work again
        made = await _connections(redis) - before
    assert made <= 2, f"{made} connections made for 8 jobs"


async def test_an_idle_worker_gets_a_job_enqueued_through_its_queue_with_no_claim_of_its_own(
    queue: JobQueue, tmp_path: Path
) -> None:
    """A single-machine pool's server enqueues through the JobQueue its slots claim through: an
    idle slot's claim stands there and goes in the enqueue's round trip (fast_path.Standing), so the
    job starts without a claim round trip after it."""
    async with running_worker(queue, tmp_path / "w", slots=1, heartbeat_seconds=600):
        # (not a short job, after which it would claim ahead; and the enqueue script loaded: a
        # batch with a call Redis does not know yet sends that call again, after the claim)
        first, _ = await queue.enqueue(sh("sleep 0.2"))
        await wait_state(queue, first, JobState.SUCCEEDED)
        await asyncio.sleep(0.5)  # idle: its claim found nothing, and it waits for work
        claims = 0
        claim_many = queue.claim_many

        async def counted(*args: Any, **kwargs: Any) -> list[Lease]:
            nonlocal claims
            claims += 1
            return await claim_many(*args, **kwargs)

        queue.claim_many = counted  # type: ignore[method-assign]
        job_id, _ = await queue.enqueue(sh("echo started > started; sleep 0.5", cwd=str(tmp_path)))
        await wait_file(tmp_path / "started")
        assert claims == 0
        await wait_state(queue, job_id, JobState.SUCCEEDED)


async def test_a_worker_whose_heartbeats_fail_claims_nothing_through_its_standing_claim(
    queue: JobQueue, tmp_path: Path
) -> None:
    """A worker claims nothing while its heartbeats fail (what it claimed might not be renewed):
    nor does the claim it left standing before they failed, when an enqueue comes meanwhile."""
    async with running_worker(queue, tmp_path / "w", slots=1, heartbeat_seconds=600) as worker:
        first, _ = await queue.enqueue(sh("sleep 0.2"))
        await wait_state(queue, first, JobState.SUCCEEDED)
        await asyncio.sleep(0.5)  # idle: its claim stands
        worker.heartbeat.healthy.clear()  # as a beat that failed leaves it
        job_id, _ = await queue.enqueue(sh("true"))
        await asyncio.sleep(0.5)
        assert (await queue.get(job_id)).state is JobState.QUEUED
        worker.heartbeat.healthy.set()  # a beat got through: it claims again
        await wait_state(queue, job_id, JobState.SUCCEEDED)


async def test_a_job_taken_by_the_standing_claim_costs_its_worker_no_claim_of_its_own(
    queue: JobQueue, redis: Redis, tmp_path: Path
) -> None:
    """The standing claim of an idle worker with two slots took the one job there was, and found
    the queue empty: as after a claim that got fewer jobs than it asked for, the worker waits
    for work rather than claim again at once, and the blocking read woken by that very job
    (sent before it) is no news. Each of these had cost every job one claim that found
    nothing, on the worker's loop and on Redis while the job was starting."""
    async with running_worker(queue, tmp_path / "w", slots=2, heartbeat_seconds=600):
        first, _ = await queue.enqueue(sh("sleep 0.2"))
        await wait_state(queue, first, JobState.SUCCEEDED)
        await asyncio.sleep(0.5)  # idle: its claim found nothing, and it waits for work
        claims = 0
        claim_many = queue.claim_many

        async def counted(*args: Any, **kwargs: Any) -> list[Lease]:
            nonlocal claims
            claims += 1
            return await claim_many(*args, **kwargs)

        queue.claim_many = counted  # type: ignore[method-assign]
        job_id, _ = await queue.enqueue(sh("echo started > started; sleep 0.5", cwd=str(tmp_path)))
        await wait_file(tmp_path / "started")
        await asyncio.sleep(0.3)
        assert claims == 0
        assert (await queue.get(job_id)).state is JobState.RUNNING
        # and work that comes from elsewhere still wakes it, for its other slot
        other, _ = await JobQueue(redis).enqueue(sh("true"))
        await wait_state(queue, other, JobState.SUCCEEDED)
        assert claims >= 1
        await wait_state(queue, job_id, JobState.SUCCEEDED)


async def test_a_read_that_answers_an_entry_a_claim_has_seen_since_wakes_nobody(
    queue: JobQueue, redis: Redis
) -> None:
    """The read is kept from one wait to the next, so it may answer an entry that a claim made
    between the two waits took: the next wait sends a new read, after what that claim saw, and
    goes on waiting; an entry no claim has seen ends it."""
    other = JobQueue(redis)  # enqueues with no claim standing
    watch = WorkWatch(queue, "w1", ["default"])
    try:
        assert await queue.claim_many("w1", ["default"], 2) == []  # the cursors: nothing yet
        wake = asyncio.Event()
        waiting = asyncio.ensure_future(watch.wait(wake, None))
        await asyncio.sleep(0.1)
        wake.set()  # the wait ends (a slot freed, say) and leaves its read in flight
        assert await asyncio.wait_for(waiting, 5) is None
        job_id, _ = await other.enqueue(sh("true"))
        assert [lease.job_id for lease in await queue.claim_many("w1", ["default"], 2)] == [job_id]
        await asyncio.sleep(0.1)  # the read has answered that job's entry by now
        waiting = asyncio.ensure_future(watch.wait(asyncio.Event(), None))
        await asyncio.sleep(0.3)
        assert not waiting.done(), "woken by an entry the claim had taken"
        await other.enqueue(sh("true"))
        assert await asyncio.wait_for(waiting, 5) is None  # news: the caller claims
    finally:
        await watch.close()
