"""Fair share (claim.lua): in a queue so configured, the next start goes to the user with the least
recent use per weight, FIFO within one user; against one redis-server and a Redis Cluster."""

from __future__ import annotations

import asyncio

import pytest

from daemon.job import JobSpec, JobState, Lease, Outcome
from daemon.queue import keys
from daemon.queue.claims import Capacity
from daemon.queue.connection import AnyRedis
from daemon.queue.explain import explain
from daemon.queue.job_queue import JobQueue

OK = Outcome(JobState.SUCCEEDED, exit_code=0)
HOUR = 3600.0


@pytest.fixture
def redis(either_redis: AnyRedis) -> AnyRedis:
    return either_redis


def fair(redis: AnyRedis, half_life: float = HOUR, **kw: object) -> JobQueue:
    return JobQueue(redis, lease_seconds=30, fairshare=["default"], fairshare_half_life=half_life, **kw)  # type: ignore[arg-type]


def spec(user: str, n: int = 0, **kw: object) -> JobSpec:
    return JobSpec(argv=("echo", str(n)), user=user, **kw)  # type: ignore[arg-type]


async def enqueue(queue: JobQueue, user: str, n: int, **kw: object) -> list[str]:
    return await queue.enqueue_many([spec(user, i, **kw) for i in range(n)])


async def started(queue: JobQueue, count: int, worker: str = "w1", **kw: object) -> list[str]:
    return [lease.job_id for lease in await queue.claim_many(worker, ["default"], count, **kw)]  # type: ignore[arg-type]


async def run_for(queue: JobQueue, user: str, seconds: float) -> None:
    """`user` runs one job for `seconds`: their recent use, charged as the attempt ends."""
    (job_id,) = await enqueue(queue, user, 1)
    lease = await queue.claim("w0", ["default"])
    assert lease is not None
    assert lease.job_id == job_id
    await asyncio.sleep(seconds)
    await queue.complete(lease, OK)


async def test_a_burst_of_starts_alternates_between_users_and_each_user_keeps_fifo(redis: AnyRedis) -> None:
    queue = fair(redis)
    alice = await enqueue(queue, "alice", 4)
    bob = await enqueue(queue, "bob", 3)
    # Plain FIFO would start alice's four; fair share alternates, oldest first among equals.
    assert await started(queue, 6) == [alice[0], bob[0], alice[1], bob[1], alice[2], bob[2]]
    assert await started(queue, 6) == [alice[3]]
    assert await queue.depth("default") == 0


async def test_the_user_with_less_recent_use_goes_first_until_the_decay_evens_it_out(
    redis: AnyRedis,
) -> None:
    queue = fair(redis)
    await run_for(queue, "alice", 0.3)  # about 300 GPU-ms of use (a job without GPUs counts one)
    alice = await enqueue(queue, "alice", 2)
    bob = await enqueue(queue, "bob", 2)
    first = await queue.claim_many("w1", ["default"], 1)
    assert [lease.job_id for lease in first] == [bob[0]]  # alice enqueued first, but used more
    await queue.complete(first[0], OK)  # bob's use: a few ms, still less than alice's
    second = await queue.claim_many("w1", ["default"], 1)
    assert [lease.job_id for lease in second] == [bob[1]]
    await queue.complete(second[0], OK)
    # With a half-life of 20 ms, alice's 300 GPU-ms are gone within a second, as are bob's few:
    # back to even, the older job goes first.
    quick = fair(redis, half_life=0.02)
    await asyncio.sleep(1.0)
    more = await enqueue(quick, "bob", 1)
    assert await started(quick, 2, "w2") == [alice[0], more[0]]  # (w2: a JobQueue numbers its own)


async def test_a_weight_divides_recent_use(redis: AnyRedis) -> None:
    queue = fair(redis)
    await run_for(queue, "alice", 0.1)
    await run_for(queue, "bob", 0.3)  # three times alice's use, and four times her weight
    await queue.set_fairshare_weights({"bob": 4})
    alice = await enqueue(queue, "alice", 1)
    bob = await enqueue(queue, "bob", 1)
    assert await started(queue, 2) == [bob[0], alice[0]]
    await queue.set_fairshare_weights({})  # weights replaced: bob counts 1 again
    assert not await redis.hexists(keys.fairshare("default"), "w:bob")


async def test_fair_share_keeps_caps_priorities_the_front_and_head_of_line(redis: AnyRedis) -> None:
    queue = fair(redis, user_caps=(1, 0))
    alice = await enqueue(queue, "alice", 2, gpus=1)
    bob = await enqueue(queue, "bob", 1, gpus=2)
    urgent = await enqueue(queue, "carol", 1, gpus=1, priority=5)
    # carol's priority job first; then alice's (oldest, no use); bob's 2 GPUs wait at the head,
    # and alice, at her cap of one job, is passed over.
    got = await queue.claim_many("w1", ["default"], 4, Capacity(gpus_free=3, gpus_total=4))
    assert [lease.job_id for lease in got] == [urgent[0], alice[0]]
    assert await queue.claim_many("w1", ["default"], 4, Capacity(gpus_free=1, gpus_total=4)) == []
    await queue.hand_back(got[1])  # alice's job handed back: the front, before every line
    again = await queue.claim_many("w1", ["default"], 4, Capacity(gpus_free=2, gpus_total=4))
    assert [(lease.job_id, lease.attempt) for lease in again] == [(alice[0], 2)]
    rest = await queue.claim_many("w2", ["default"], 4, Capacity(gpus_free=4, gpus_total=4))
    assert [lease.job_id for lease in rest] == [bob[0]]  # alice still at her cap
    assert await queue.cancel(alice[1]) == "cancelled"  # a job in a line cancelled never starts
    for lease in [got[0], *again, *rest]:
        await queue.complete(lease, OK)
    assert await started(queue, 4) == []
    assert await queue.depth("default") == 0


async def test_a_job_in_a_line_is_listed_shown_and_never_lost_to_a_reclaim(redis: AnyRedis) -> None:
    queue = fair(redis)
    alice = await enqueue(queue, "alice", 3)
    lease: Lease | None = await queue.claim("w1", ["default"])
    assert lease is not None
    assert lease.job_id == alice[0]
    assert await queue.depth("default") == 2
    listed = [j.id for j in await queue.list_jobs() if j.state is JobState.QUEUED]
    assert listed == alice[1:]
    judged = await explain(queue, "default", listed, 1)  # as `show` judges them: in alice's line
    assert [(j.place, j.verdict, j.running) for j in judged.values()] == [("held", "start", 1)] * 2
    await redis.zadd(keys.leases("default"), {lease.job_id: 0})  # its worker went silent
    assert await queue.reclaim() == [(alice[0], JobState.QUEUED)]
    again = await queue.claim_many("w2", ["default"], 3)
    assert [(x.job_id, x.attempt) for x in again] == [(alice[0], 2), (alice[1], 1), (alice[2], 1)]


async def test_a_priority_job_held_at_a_cap_keeps_its_place_before_its_users_later_ones(
    redis: AnyRedis,
) -> None:
    """The chaos suite with the policies on found it: in a fair-share queue a priority job whose
    user was at a cap went to the user's line, and the user's later priority job, still in
    `prio`, started before it once the user was below the cap."""
    queue = fair(redis, user_caps=(1, 0))
    (running,) = await enqueue(queue, "alice", 1)
    lease = await queue.claim("w0", ["default"])
    assert lease is not None
    assert lease.job_id == running
    first = await enqueue(queue, "alice", 1, priority=5)
    assert await started(queue, 1) == []  # alice at her cap: it waits, in place
    second = await enqueue(queue, "alice", 1, priority=5)
    await queue.complete(lease, OK)
    assert await started(queue, 1) == first
    assert await started(queue, 1, "w2") == []
    assert (await queue.get(second[0])).state is JobState.QUEUED


async def test_a_reclaimed_job_of_a_user_at_the_cap_keeps_its_place_at_the_front(redis: AnyRedis) -> None:
    """issue 43 item 7 (fair share): a job taken back from a dead worker goes to the front, before
    every job not yet started; its user at a cap, it was held in their fair-share line instead,
    and once they were below the cap it waited its user's turn behind the jobs of users with
    less recent use. Now it goes first, as the front does."""
    await run_for(fair(redis), "alice", 0.3)  # alice has used more than bob
    alice = await enqueue(fair(redis), "alice", 2)
    uncapped = await fair(redis).claim_many("w9", ["default"], 2)  # (a worker without caps)
    assert [lease.job_id for lease in uncapped] == alice
    await redis.zadd(keys.leases("default"), {alice[1]: 0})  # that worker went silent for one
    assert await fair(redis).reclaim() == [(alice[1], JobState.QUEUED)]
    queue = fair(redis, user_caps=(1, 0))
    bob = await enqueue(queue, "bob", 2)
    meanwhile = await queue.claim_many("w1", ["default"], 1)
    assert [lease.job_id for lease in meanwhile] == [bob[0]]  # alice at her cap: bob's meanwhile
    for lease in (uncapped[0], *meanwhile):
        await queue.complete(lease, OK)  # both below their caps; alice with more recent use
    again = await queue.claim_many("w1", ["default"], 1)
    assert [(lease.job_id, lease.attempt) for lease in again] == [(alice[1], 2)]
    assert await started(queue, 1) == [bob[1]]
