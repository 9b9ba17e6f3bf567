"""The scheduler's parts (lua/claim/), where a review of their split found them wrong: each test
names the finding (issue 46). Against one redis-server and a Redis Cluster."""

from __future__ import annotations

import pytest

from daemon.job import JobSpec, JobState
from daemon.queue import keys
from daemon.queue.claims import Capacity, SharedGpu
from daemon.queue.connection import AnyRedis
from daemon.queue.explain import explain
from daemon.queue.job_queue import JobQueue

GIB = 2**30


@pytest.fixture
def redis(either_redis: AnyRedis) -> AnyRedis:
    return either_redis


async def test_a_job_queued_before_the_upgrade_keeps_its_time_limit(redis: AnyRedis) -> None:
    """issue 46 review: a record of before 'time_limit_ms' was taken as having no time limit, so a
    pilot passed over every job queued before the upgrade. Its spec still says its limit."""
    queue = JobQueue(redis, lease_seconds=30)
    (old,) = await queue.enqueue_many([JobSpec(argv=("true",), timeout=10.0)])
    await redis.hdel(keys.job(old), "time_limit_ms", "stop_grace_ms")  # as enqueued before
    got = await queue.claim_many("pilot", ["default"], 1, Capacity(lifetime=50.0))
    assert [lease.job_id for lease in got] == [old]


async def test_a_claim_answered_again_counts_its_gpus_out(redis: AnyRedis) -> None:
    """issue 46 review: a request sent again (its reply lost) answered its lease but said the
    worker's GPUs were all free, so claim_many's next queue claimed onto the same GPUs."""
    queue = JobQueue(redis, lease_seconds=30)
    (big,) = await queue.enqueue_many([JobSpec(argv=("true",), gpus=4)])
    request = queue._request("w1", "default", 1, 1, Capacity(4, gpus_total=4))
    first = await queue._claim_call(request)
    again = await queue._claim_call(request)
    assert [lease.job_id for lease in again.leases] == [lease.job_id for lease in first.leases] == [big]
    assert (first.gpus_free, again.gpus_free) == (0, 0)


async def test_show_explains_an_unknown_job_in_a_fair_share_queue(redis: AnyRedis) -> None:
    """issue 46 review: explain compared a missing record's seq (nil) with a number when the
    ranks tied: `poolctl show` of a mistyped id beside a real one failed."""
    queue = JobQueue(redis, lease_seconds=30, fairshare=["default"])
    (real,) = await queue.enqueue_many([JobSpec(argv=("true",), user="alice")])
    judged = await explain(queue, "default", ["default.nosuchjob", real], 0)
    assert (judged["default.nosuchjob"].place, judged[real].place) == ("gone", "stream")


async def test_a_parked_job_too_big_for_a_bigger_worker_too_does_not_reserve_it(redis: AnyRedis) -> None:
    """issue 46 review (in the old claim.lua too): a --gpu-mem job parked by a worker of 2 GPUs of
    24 GiB reached a worker of 4 such GPUs from `parked`, was too big there as well, and reserved
    it as a head job: nothing else started there. It is parked again, for this worker's size."""
    queue = JobQueue(redis, lease_seconds=30)
    (big,) = await queue.enqueue_many([JobSpec(argv=("true",), gpu_mem=40 * GIB)])

    def worker(gpus: int) -> Capacity:
        table = [SharedGpu(i, 24 * GIB, 4, shared=False) for i in range(gpus)]
        return Capacity(gpus, gpus_total=gpus, shared=table, largest_gpu=24 * GIB)

    assert await queue.claim_many("w2", ["default"], 1, worker(2)) == []  # parked
    (small,) = await queue.enqueue_many([JobSpec(argv=("true",), gpus=1)])
    got = await queue.claim_many("w4", ["default"], 1, worker(4))
    assert [lease.job_id for lease in got] == [small]
    assert (await queue.get(big)).state is JobState.QUEUED


async def test_a_run_of_big_jobs_does_not_hide_a_users_small_one_in_a_fair_share_line(
    redis: AnyRedis,
) -> None:
    """issue 46 review: with a job too big for a worker kept in its user's line (so it keeps its
    place in their order), a worker looked only HELD_LOOK deep: 21 big jobs hid the small one."""
    queue = JobQueue(redis, lease_seconds=30, fairshare=["default"])
    await queue.enqueue_many([JobSpec(argv=("true",), user="alice", gpus=8)] * 21)
    (small,) = await queue.enqueue_many([JobSpec(argv=("true",), user="alice", gpus=1)])
    got = await queue.claim_many("w4", ["default"], 1, Capacity(4, gpus_total=4))
    assert [lease.job_id for lease in got] == [small]


async def test_a_gpu_mem_job_on_a_worker_with_no_gpu_to_share_waits_rather_than_breaks_the_claim(
    redis: AnyRedis,
) -> None:
    """issue 46 review (in the old claim.lua too): with every GPU free and none in the shared
    table, the claim took the next entry without a look and packed a --gpu-mem job onto no GPU:
    the script failed halfway, its entry delivered and the job stranded. It waits now."""
    queue = JobQueue(redis, lease_seconds=30)
    (job,) = await queue.enqueue_many([JobSpec(argv=("true",), gpu_mem=30 * GIB)])
    assert await queue.claim_many("w1", ["default"], 1, Capacity(2, gpus_total=2, largest_gpu=80 * GIB)) == []
    table = [SharedGpu(0, 80 * GIB, 4, shared=False)]
    room = Capacity(2, gpus_total=2, shared=table, largest_gpu=80 * GIB)
    assert [lease.job_id for lease in await queue.claim_many("w1", ["default"], 1, room)] == [job]


async def test_a_job_queued_before_the_upgrade_backfills_by_its_time_limit(redis: AnyRedis) -> None:
    """issue 46: a backfill looks at the jobs behind a head reading only what a verdict needs
    (claim/job.lua `peek`), not their specs; a record of before 'time_limit_ms' has its limit in
    its spec alone, and must still be seen to end before the head can start."""
    queue = JobQueue(redis, lease_seconds=30)
    _head, old = await queue.enqueue_many(
        [JobSpec(argv=("true",), gpus=4), JobSpec(argv=("true",), gpus=1, timeout=5.0)]
    )
    await redis.hdel(keys.job(old), "time_limit_ms", "stop_grace_ms")  # as enqueued before
    room = Capacity(2, gpus_total=4, ends=[(60.0, 2)])  # the head waits a minute for 2 GPUs
    got = await queue.claim_many("w1", ["default"], 2, room)
    assert [lease.job_id for lease in got] == [old]
