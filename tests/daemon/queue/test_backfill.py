"""Backfill with a reservation (claim.lua): the head job that must wait for GPUs reserves a worker;
jobs behind it start elsewhere, and on the reserved worker only if they are sure to end before the
head could start there. Against one redis-server and a Redis Cluster."""

from __future__ import annotations

import pytest

from daemon.job import JobSpec, JobState, Lease, Outcome
from daemon.queue import keys
from daemon.queue.claims import Capacity
from daemon.queue.connection import AnyRedis
from daemon.queue.job_queue import JobQueue

OK = Outcome(JobState.SUCCEEDED, exit_code=0)


@pytest.fixture
def redis(either_redis: AnyRedis) -> AnyRedis:
    return either_redis


def spec(n: int, gpus: int, timeout: float | None = None, **kw: object) -> JobSpec:
    return JobSpec(argv=("echo", str(n)), gpus=gpus, timeout=timeout, stop_grace=1, **kw)  # type: ignore[arg-type]


async def claim(
    queue: JobQueue, worker: str, free: int, ends: list[tuple[float | None, int]], count: int = 4
) -> list[str]:
    got = await queue.claim_many(worker, ["default"], count, Capacity(free, gpus_total=4, ends=ends, grace=1))
    return [lease.job_id for lease in got]


async def test_behind_a_reserved_head_only_jobs_sure_to_end_first_start_on_its_worker(
    redis: AnyRedis,
) -> None:
    queue = JobQueue(redis, lease_seconds=30)
    (running,) = await queue.enqueue_many([spec(0, 2, timeout=100)])
    assert await claim(queue, "w1", 4, []) == [running]  # w1: 2 of its 4 GPUs busy for 101 s at most
    head, short, endless, late = await queue.enqueue_many(
        [spec(1, 4), spec(2, 1, timeout=30), spec(3, 1), spec(4, 1, timeout=200)]
    )
    # The head needs 4 GPUs: it reserves w1. Of the jobs behind it, only the one whose 30 s (+1 s
    # grace) end before the head could start there (101 s) starts on w1.
    assert await claim(queue, "w1", 2, [(101, 2)]) == [short]
    reservation = await redis.hgetall(keys.reservation("default"))
    assert (reservation[b"job"], reservation[b"worker"]) == (head.encode(), b"w1")
    # Another worker, the head not reserved on it, takes the jobs behind it as they come.
    assert await claim(queue, "w2", 3, [(None, 1)]) == [endless, late]
    assert (await queue.get(head)).state is JobState.QUEUED


async def test_a_running_job_without_a_time_limit_leaves_no_room_to_backfill_on_the_reserved_worker(
    redis: AnyRedis,
) -> None:
    queue = JobQueue(redis, lease_seconds=30)
    (running,) = await queue.enqueue_many([spec(0, 2)])
    assert await claim(queue, "w1", 4, []) == [running]
    _head, short = await queue.enqueue_many([spec(1, 4), spec(2, 1, timeout=1)])
    # The running job may end any moment: the head could start any moment, nothing goes first.
    assert await claim(queue, "w1", 2, [(None, 2)]) == []
    assert await claim(queue, "w1", 2, []) == []  # (nor with nothing known of what runs)
    assert (await queue.get(short)).state is JobState.QUEUED


async def test_the_reserved_head_starts_as_soon_as_its_worker_has_the_gpus(redis: AnyRedis) -> None:
    queue = JobQueue(redis, lease_seconds=30)
    (running,) = await queue.enqueue_many([spec(0, 2, timeout=100)])
    (lease,) = await queue.claim_many("w1", ["default"], 1, Capacity(4, gpus_total=4))
    head, *small = await queue.enqueue_many([spec(1, 4), *(spec(2 + i, 1, timeout=10) for i in range(3))])
    assert await claim(queue, "w1", 2, [(101, 2)], count=2) == small[:2]
    # A steady stream of small jobs: once w1's GPUs are free, the head goes first, not them.
    more = await queue.enqueue_many([spec(9, 1, timeout=10)])
    await queue.complete(lease, OK)
    assert await claim(queue, "w1", 4, [], count=3) == [head]
    assert (await queue.get(small[2])).state is JobState.QUEUED
    assert (await queue.get(more[0])).state is JobState.QUEUED
    assert (await queue.get(running)).state is JobState.SUCCEEDED


async def test_a_reservation_lapses_with_its_worker_and_passes_to_the_next(redis: AnyRedis) -> None:
    queue = JobQueue(redis, lease_seconds=1)
    _head, behind = await queue.enqueue_many([spec(1, 4), spec(2, 1)])
    assert await claim(queue, "w1", 2, [(None, 2)]) == []  # w1 reserves the head
    assert await claim(queue, "w2", 3, [(None, 1)]) == [behind]  # w2 backfills freely
    await redis.hset(keys.reservation("default"), "until", 0)  # w1 fell silent: its lease ran out
    (after,) = await queue.enqueue_many([spec(3, 1)])
    assert await claim(queue, "w2", 2, [(None, 1), (None, 1)]) == []  # w2 holds it now
    reservation = await redis.hgetall(keys.reservation("default"))
    assert reservation[b"worker"] == b"w2"
    assert (await queue.get(after)).state is JobState.QUEUED


async def test_a_head_reserved_in_one_queue_keeps_its_gpus_from_the_next(redis: AnyRedis) -> None:
    queue = JobQueue(redis, lease_seconds=30)
    (head,) = await queue.enqueue_many([spec(1, 4, queue="urgent")])
    (other,) = await queue.enqueue_many([spec(2, 1)])
    got: list[Lease] = await queue.claim_many(
        "w1", ["urgent", "default"], 2, Capacity(2, gpus_total=4, ends=[(None, 2)], grace=1)
    )
    assert got == []  # the urgent head keeps w1's free GPUs, from the default queue too
    got = await queue.claim_many(
        "w2", ["urgent", "default"], 2, Capacity(2, gpus_total=4, ends=[(None, 2)], grace=1)
    )
    assert [lease.job_id for lease in got] == [other]  # w2 is not reserved: it backfills
    assert (await queue.get(head)).state is JobState.QUEUED
