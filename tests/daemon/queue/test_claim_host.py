"""The scheduler's host part (lua/claim/host.lua): a worker's CPUs and memory fitted with its GPUs
(issue 50). Against one redis-server and a Redis Cluster, through the claim itself."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from daemon.job import JobSpec, JobState
from daemon.queue.claims import Capacity
from daemon.queue.connection import AnyRedis
from daemon.queue.explain import explain
from daemon.queue.job_queue import JobQueue

GIB = 2**30


@pytest.fixture
def redis(either_redis: AnyRedis) -> AnyRedis:
    return either_redis


def host(
    cpus_free: int,
    mem_free: int,
    *,
    cpus: int = 4,
    mem: int = 16 * GIB,
    host_ends: Sequence[tuple[float | None, int, int]] = (),
) -> Capacity:
    """A worker without GPUs of `cpus` CPUs and `mem` bytes for jobs, this much of each free."""
    return Capacity(
        cpus_free=cpus_free, cpus_total=cpus, mem_free=mem_free, mem_total=mem, host_ends=host_ends
    )


async def test_a_job_is_started_only_where_its_cpus_and_memory_are_free(redis: AnyRedis) -> None:
    """issue 50, CPU and memory as resources: the scheduler fits them as it fits GPUs. What one
    job takes in a claim is counted out for the next (two jobs of 3 CPUs on 4 free: one starts),
    and the claim's reply says what is left, for the worker's next queue."""
    queue = JobQueue(redis, lease_seconds=30)
    first, second = await queue.enqueue_many([JobSpec(argv=("true",), cpus=3, mem=GIB)] * 2)
    reply = await queue._claim_call(queue._request("w1", "default", 1, 2, host(4, 16 * GIB)))
    assert [lease.job_id for lease in reply.leases] == [first]
    assert (reply.status, reply.cpus_free, reply.mem_free) == (b"blocked", 1, 15 * GIB)
    assert (await queue.get(second)).state is JobState.QUEUED


async def test_the_claim_passes_over_a_job_that_does_not_fit_free_cpus_and_takes_one_behind(
    redis: AnyRedis,
) -> None:
    """issue 50, backfill as for GPUs: a job waiting for CPUs (2 of 4 are taken by a job ending in
    a minute at most) is the head; behind it a job that fits what is free and ends before the head
    could start does start, one that fits but has no time limit does not (it could delay the head),
    and one asking for memory that is not free waits too."""
    queue = JobQueue(redis, lease_seconds=30)
    head, endless, too_much_mem, short = await queue.enqueue_many(
        [
            JobSpec(argv=("true",), cpus=4),
            JobSpec(argv=("true",), cpus=1),
            JobSpec(argv=("true",), cpus=1, mem=12 * GIB, timeout=5.0),
            JobSpec(argv=("true",), cpus=1, mem=GIB, timeout=5.0),
        ]
    )
    room = host(2, 8 * GIB, host_ends=[(60.0, 2, 8 * GIB)])
    got = await queue.claim_many("w1", ["default"], 4, room)
    assert [lease.job_id for lease in got] == [short]
    for waiting in (head, endless, too_much_mem):
        assert (await queue.get(waiting)).state is JobState.QUEUED


async def test_a_job_asking_more_cpus_or_memory_than_the_worker_has_is_parked(redis: AnyRedis) -> None:
    """issue 50: a job needing more CPUs (or memory) than a worker has at all never blocks it, as
    one of too many GPUs never does; `poolctl show`'s verdict says why, and a big enough worker
    takes it."""
    queue = JobQueue(redis, lease_seconds=30)
    many_cpus, much_mem, small = await queue.enqueue_many(
        [
            JobSpec(argv=("true",), cpus=8),
            JobSpec(argv=("true",), mem=32 * GIB),
            JobSpec(argv=("true",), cpus=1),
        ]
    )
    got = await queue.claim_many("w4", ["default"], 3, host(4, 16 * GIB))
    assert [lease.job_id for lease in got] == [small]
    request = queue._request("explain", "default", 0, 0, host(4, 16 * GIB))
    rows = await queue.scripts.explain(keys=request.keys(), args=[request.packed(), many_cpus, much_mem])
    assert [(r[2], r[3]) for r in rows] == [(b"park", b"too_many_cpus"), (b"park", b"too_much_memory")]
    assert (await explain(queue, "default", [many_cpus], 0))[many_cpus].verdict == "start"  # not counted
    big = host(8, 64 * GIB, cpus=8, mem=64 * GIB)
    got = await queue.claim_many("w8", ["default"], 2, big)
    assert sorted(lease.job_id for lease in got) == sorted([many_cpus, much_mem])


async def test_a_claim_answered_again_counts_its_cpus_and_memory_out(redis: AnyRedis) -> None:
    """issue 50: a request sent again (its reply lost) answers the same lease, and says the CPUs
    and memory its job took are not free, as it does for GPUs: the worker, which never heard of
    the job, sent them as free, and its next queue's claim must not count them twice."""
    queue = JobQueue(redis, lease_seconds=30)
    (job,) = await queue.enqueue_many([JobSpec(argv=("true",), cpus=3, mem=4 * GIB)])
    request = queue._request("w1", "default", 1, 1, host(4, 16 * GIB))
    first = await queue._claim_call(request)
    again = await queue._claim_call(request)
    assert [lease.job_id for lease in again.leases] == [lease.job_id for lease in first.leases] == [job]
    assert (first.cpus_free, first.mem_free) == (again.cpus_free, again.mem_free) == (1, 12 * GIB)


async def test_a_head_waiting_for_cpus_keeps_them_from_the_workers_next_queue(redis: AnyRedis) -> None:
    """issue 50 review: the head of one queue kept its GPUs from the queues its worker claims from
    next in the same call, but not its CPUs or memory: a head needing no GPU kept nothing, and a
    job of the next queue with no time limit took the CPUs it waited for. Now one that could delay
    the head waits, and one sure to end before the head could start (60 s) starts, as in the
    head's own queue."""
    queue = JobQueue(redis, lease_seconds=30)
    (head,) = await queue.enqueue_many([JobSpec(argv=("head",), cpus=4, queue="urgent")])
    endless, short = await queue.enqueue_many(
        [JobSpec(argv=("endless",), cpus=1), JobSpec(argv=("short",), cpus=1, timeout=5.0)]
    )
    room = host(2, 16 * GIB, host_ends=[(60.0, 2, 0)])
    got = await queue.claim_many("w1", ["urgent", "default"], 3, room)
    assert [lease.job_id for lease in got] == [short]
    for waiting in (head, endless):
        assert (await queue.get(waiting)).state is JobState.QUEUED


async def test_a_head_kept_from_the_next_queue_could_start_once_all_it_needs_is_free(
    redis: AnyRedis,
) -> None:
    """issue 50 review: across queues the head's start was counted from its GPUs alone, free now,
    so nothing of the next queue backfilled, though the CPUs the head waits for are held for a
    minute: a job ending well before that starts, as it would in the head's own queue."""
    queue = JobQueue(redis, lease_seconds=30)
    (head,) = await queue.enqueue_many([JobSpec(argv=("head",), gpus=1, cpus=4, queue="urgent")])
    (short,) = await queue.enqueue_many([JobSpec(argv=("short",), gpus=1, cpus=1, timeout=5.0)])
    room = Capacity(2, gpus_total=4, ends=[(None, 2)], cpus_free=1, cpus_total=4, host_ends=[(60.0, 3, 0)])
    got = await queue.claim_many("w1", ["urgent", "default"], 2, room)
    assert [lease.job_id for lease in got] == [short]
    assert (await queue.get(head)).state is JobState.QUEUED
