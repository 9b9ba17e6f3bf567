"""GPU memory packing in the claim (claim.lua): a --gpu-mem job goes on a GPU of the worker's table
with room, the fullest shared one first, else a GPU free whole, which whole-GPU jobs then cannot
have. Against one redis-server and a Redis Cluster."""

from __future__ import annotations

from typing import Any

import pytest

from daemon.job import JobSpec
from daemon.queue.claims import Capacity, SharedGpu
from daemon.queue.connection import AnyRedis
from daemon.queue.explain import explain
from daemon.queue.job_queue import JobQueue
from daemon.server.pending import PendingReasons

GIB = 2**30


@pytest.fixture
def redis(either_redis: AnyRedis) -> AnyRedis:
    return either_redis


def mem(n: int, gib: int) -> JobSpec:
    return JobSpec(argv=("echo", str(n)), gpu_mem=gib * GIB)


def whole(n: int, gpus: int) -> JobSpec:
    return JobSpec(argv=("echo", str(n)), gpus=gpus)


async def test_two_jobs_share_a_gpu_a_third_waits_and_whole_gpu_jobs_never_share(redis: AnyRedis) -> None:
    queue = JobQueue(redis, lease_seconds=30)
    a, b, c, big = await queue.enqueue_many([mem(0, 30), mem(1, 30), mem(2, 30), whole(3, 1)])
    # One 80 GiB GPU, free whole: the first two jobs share it; the third does not fit beside them.
    table = [SharedGpu(0, 80 * GIB, 4, shared=False)]
    got = await queue.claim_many(
        "w1", ["default"], 4, Capacity(1, gpus_total=1, shared=table, largest_gpu=80 * GIB)
    )
    assert [(lease.job_id, lease.shared_gpu) for lease in got] == [(a, 0), (b, 0)]
    # As the worker sees it then: the GPU shared, 20 GiB left. The third waits at the head, and the
    # whole-GPU job behind it waits too (head of line): the one GPU is not free whole.
    table = [SharedGpu(0, 20 * GIB, 2, shared=True)]
    assert (
        await queue.claim_many(
            "w1", ["default"], 2, Capacity(0, gpus_total=1, shared=table, largest_gpu=80 * GIB)
        )
        == []
    )
    got = await queue.claim_many(
        "w1",
        ["default"],
        2,
        Capacity(0, gpus_total=1, shared=[SharedGpu(0, 50 * GIB, 3, True)], largest_gpu=80 * GIB),
    )
    assert [(lease.job_id, lease.shared_gpu) for lease in got] == [(c, 0)]
    assert big not in [lease.job_id for lease in got]


async def test_shared_jobs_pack_onto_the_fullest_gpu_and_leave_the_others_whole(redis: AnyRedis) -> None:
    queue = JobQueue(redis, lease_seconds=30)
    small, two = await queue.enqueue_many([mem(0, 10), whole(1, 2)])
    table = [
        SharedGpu(1, 30 * GIB, 1, shared=True),  # already shared, 30 GiB left
        SharedGpu(0, 80 * GIB, 4, shared=False),
        SharedGpu(2, 80 * GIB, 4, shared=False),
    ]
    got = await queue.claim_many(
        "w1", ["default"], 2, Capacity(2, gpus_total=3, shared=table, largest_gpu=80 * GIB)
    )
    # The 10 GiB job goes beside the others on GPU 1; both free GPUs stay whole for the 2-GPU job.
    assert [(lease.job_id, lease.shared_gpu) for lease in got] == [(small, 1), (two, -1)]


async def test_opening_a_free_gpu_to_share_takes_it_from_the_whole_gpu_jobs(redis: AnyRedis) -> None:
    queue = JobQueue(redis, lease_seconds=30)
    shared, one = await queue.enqueue_many([mem(0, 10), whole(1, 1)])
    table = [SharedGpu(0, 80 * GIB, 4, shared=False)]
    got = await queue.claim_many(
        "w1", ["default"], 2, Capacity(1, gpus_total=1, shared=table, largest_gpu=80 * GIB)
    )
    assert [lease.job_id for lease in got] == [shared]  # the one GPU is shared now: `one` waits
    assert one not in [lease.job_id for lease in got]


async def test_a_job_asking_more_memory_than_the_workers_largest_gpu_is_passed_over(redis: AnyRedis) -> None:
    queue = JobQueue(redis, lease_seconds=30)
    huge, after = await queue.enqueue_many([mem(0, 100), whole(1, 1)])
    table = [SharedGpu(0, 80 * GIB, 4, shared=False)]
    got = await queue.claim_many(
        "w1", ["default"], 2, Capacity(1, gpus_total=1, shared=table, largest_gpu=80 * GIB)
    )
    assert [lease.job_id for lease in got] == [after]
    assert (await queue.get(huge)).state.value == "queued"


async def test_show_says_when_no_live_gpu_has_the_memory_a_job_asks_for(redis: AnyRedis) -> None:
    """issue 46: a --gpu-mem job bigger than every live worker's largest GPU was explained as
    "needs 0 GPUs, and no live worker has that many". The scheduler's own verdict says why
    (claim/fit.lua: 'no_gpu_memory'), and `show` puts that in words; a job that fits waits in line."""
    queue = JobQueue(redis, lease_seconds=30)
    big, fits = await queue.enqueue_many([mem(0, 100), mem(1, 30)])
    judged = await explain(queue, "default", [big, fits], 2, 80 * GIB)
    assert [(judged[i].verdict, judged[i].reason) for i in (big, fits)] == [
        ("park", "no_gpu_memory"),
        ("start", "fits"),
    ]

    async def workers() -> list[dict[str, Any]]:
        gpu = {"memory": 80 * GIB}
        return [{"health": "healthy", "queues": ["default"], "gpus": [gpu, gpu]}]

    reasons = await PendingReasons(queue, workers).of([big, fits])
    assert reasons == {
        big: "needs 100 GiB on one GPU, and no live worker's GPU has that much: the jobs behind it "
        "run meanwhile, and it starts when such a worker joins",
        fits: "1 job(s) ahead of it in queue 'default'",
    }
