"""Preemption (claim.lua), where an admin enables it for a queue: a job with a priority that must
wait for GPUs, CPUs or memory on the worker it reserved asks that worker's lower-priority jobs to
make room (taken in order while something is short, then any not needed left running), and goes
first once they have. Against one redis-server and a Redis Cluster."""

from __future__ import annotations

import pytest

from daemon.job import JobSpec, JobState, Lease, RenewStatus
from daemon.queue import keys
from daemon.queue.claims import Capacity, SharedGpu
from daemon.queue.connection import AnyRedis
from daemon.queue.job_queue import JobQueue


@pytest.fixture
def redis(either_redis: AnyRedis) -> AnyRedis:
    return either_redis


def spec(n: int, gpus: int, priority: int = 0) -> JobSpec:
    return JobSpec(argv=("echo", str(n)), gpus=gpus, priority=priority)


async def fill(queue: JobQueue, worker: str, jobs: list[JobSpec]) -> list[Lease]:
    """`worker` (4 GPUs) claims and runs `jobs`, one claim each, in order."""
    leases: list[Lease] = []
    for job in jobs:
        await queue.enqueue(job)
        free = 4 - sum(lease.spec.gpus for lease in leases)
        (lease,) = await queue.claim_many(worker, ["default"], 1, Capacity(free, gpus_total=4))
        leases.append(lease)
    return leases


async def statuses(queue: JobQueue, worker: str, leases: list[Lease]) -> list[RenewStatus]:
    got = await queue.renew(worker, leases)
    return [got[lease.id] for lease in leases]


async def test_a_priority_job_stops_as_few_lower_ones_as_make_room_and_goes_first(redis: AnyRedis) -> None:
    queue = JobQueue(redis, lease_seconds=30, preempt=["default"])
    low, newer, mid = await fill(queue, "w1", [spec(0, 1), spec(1, 1), spec(2, 1, priority=3)])
    urgent, _ = await queue.enqueue(spec(9, 2, priority=5))
    # 1 GPU free, 2 needed: one job must go, the lowest priority, the latest started of those.
    assert await queue.claim_many("w1", ["default"], 1, Capacity(1, gpus_total=4, ends=[(None, 3)])) == []
    assert await statuses(queue, "w1", [low, newer, mid]) == [
        RenewStatus.OK,
        RenewStatus.PREEMPT,
        RenewStatus.OK,
    ]
    assert await queue.hand_back(newer) is JobState.QUEUED  # the worker stopped it and handed it back
    # Back at the front, the preempted job would go first; the job that preempted it does.
    got = await queue.claim_many("w1", ["default"], 1, Capacity(2, gpus_total=4, ends=[(None, 2)]))
    assert [lease.job_id for lease in got] == [urgent]
    again = await queue.claim_many("w2", ["default"], 1, Capacity(1, gpus_total=1))
    assert [(lease.job_id, lease.attempt) for lease in again] == [(newer.job_id, 2)]


async def test_only_where_enabled_and_only_lower_priorities_are_preempted(redis: AnyRedis) -> None:
    plain = JobQueue(redis, lease_seconds=30)
    running = await fill(plain, "w1", [spec(0, 2, priority=5), spec(1, 2)])
    await plain.enqueue(spec(9, 4, priority=5))
    assert await plain.claim_many("w1", ["default"], 1, Capacity(0, gpus_total=4)) == []
    assert await statuses(plain, "w1", running) == [RenewStatus.OK, RenewStatus.OK]  # not enabled
    preempting = JobQueue(redis, lease_seconds=30, preempt=["default"])
    assert await preempting.claim_many("w2", ["default"], 1, Capacity(0, gpus_total=4)) == []
    # Enabled, but one of the two it would need has the same priority: nobody is stopped for nothing.
    assert await statuses(preempting, "w1", running) == [RenewStatus.OK, RenewStatus.OK]


async def test_a_full_worker_is_asked_for_a_slot_by_a_job_with_a_priority(redis: AnyRedis) -> None:
    queue = JobQueue(redis, lease_seconds=30, preempt=["default"])
    running = await fill(queue, "w1", [spec(0, 1), spec(1, 1)])
    urgent, _ = await queue.enqueue(spec(9, 1, priority=5))
    # Both slots taken, 2 GPUs free: the worker claims nothing, but looks whether to preempt.
    assert await queue.preempt_check("w1", ["default"], Capacity(2, 0, gpus_total=4))
    assert await statuses(queue, "w1", running) == [RenewStatus.OK, RenewStatus.PREEMPT]
    assert not await queue.preempt_check(
        "w1", ["default"], Capacity(2, 0, gpus_total=4)
    )  # asked once is enough
    assert await statuses(queue, "w1", running) == [RenewStatus.OK, RenewStatus.PREEMPT]
    await queue.hand_back(running[1])
    got = await queue.claim_many("w1", ["default"], 1, Capacity(3, gpus_total=4))
    assert [lease.job_id for lease in got] == [urgent]


async def test_a_job_that_preempted_on_one_worker_does_not_preempt_on_another_too(redis: AnyRedis) -> None:
    """Else the job it stopped, back at the front, starts on a second worker, is stopped there for
    the same job, and so on: a round of preemptions for one start (the chaos suite found it)."""
    queue = JobQueue(redis, lease_seconds=30, preempt=["default"])
    first = await fill(queue, "w1", [spec(0, 1), spec(1, 1)])
    second = await fill(queue, "w2", [spec(2, 1), spec(3, 1)])
    await queue.enqueue(spec(9, 1, priority=5))
    assert await queue.preempt_check("w1", ["default"], Capacity(2, 0, gpus_total=4))
    assert not await queue.preempt_check("w2", ["default"], Capacity(2, 0, gpus_total=4))
    assert await statuses(queue, "w1", first) == [RenewStatus.OK, RenewStatus.PREEMPT]
    assert await statuses(queue, "w2", second) == [RenewStatus.OK, RenewStatus.OK]


async def test_a_job_waiting_for_gpu_memory_preempts_nobody(redis: AnyRedis) -> None:
    """From a review: a --gpu-mem job with a priority that found no GPU with the memory passed
    the GPU count (a GPU free whole was there), so `preempt` chose no job and still said it had
    made room: the worker then held back for it, and nothing stopped."""
    queue = JobQueue(redis, lease_seconds=30, preempt=["default"])
    (low,) = await fill(queue, "w1", [spec(0, 1)])
    await queue.enqueue(JobSpec(argv=("echo", "9"), gpu_mem=60 * 2**30, priority=5))
    table = [SharedGpu(1, 24 * 2**30, 4, shared=False)]  # a free GPU, too small
    got = await queue.claim_many(
        "w1", ["default"], 1, Capacity(1, gpus_total=2, shared=table, largest_gpu=141 * 2**30)
    )
    assert got == []
    assert await statuses(queue, "w1", [low]) == [RenewStatus.OK]
    assert await redis.hget(keys.reservation("default"), "preempt") != b"1"


async def test_a_preempting_job_starts_only_within_its_users_cap(redis: AnyRedis) -> None:
    """From a review: the job a worker stopped others for started there without a look at its
    user's cap, which its user may have reached elsewhere meanwhile."""
    queue = JobQueue(redis, lease_seconds=30, preempt=["default"], user_caps=(1, 0))
    await queue.enqueue(JobSpec(argv=("low",), gpus=2, user="bob"))
    (low,) = await queue.claim_many("w1", ["default"], 1, Capacity(2, gpus_total=2))  # w1: 2 GPUs, both busy
    urgent, _ = await queue.enqueue(JobSpec(argv=("urgent",), gpus=2, priority=5, user="alice"))
    assert await queue.claim_many("w1", ["default"], 1, Capacity(0, gpus_total=2, ends=[(None, 2)])) == []
    assert await statuses(queue, "w1", [low]) == [RenewStatus.PREEMPT]
    await queue.enqueue(JobSpec(argv=("other",), priority=6, user="alice"))
    got = await queue.claim_many("w2", ["default"], 1, Capacity(4, gpus_total=4))
    assert [lease.spec.argv for lease in got] == [("other",)]  # alice at her cap of 1 now
    await queue.hand_back(low)
    assert [
        lease.spec.argv for lease in await queue.claim_many("w1", ["default"], 1, Capacity(2, gpus_total=2))
    ] != [("urgent",)]
    assert (await queue.get(urgent)).state is JobState.QUEUED


GIB = 2**30


def sized(name: str, gpus: int, cpus: int = 0, mem: int = 0, priority: int = 0) -> JobSpec:
    return JobSpec(argv=(name,), gpus=gpus, cpus=cpus, mem=mem, priority=priority)


def room(gpus: int, cpus: int, mem: int, slot_gpus: int = 0) -> Capacity:
    """What a worker of 4 GPUs, 4 CPUs and 16 GiB for jobs has free."""
    return Capacity(
        gpus, slot_gpus, gpus_total=4, cpus_free=cpus, cpus_total=4, mem_free=mem, mem_total=16 * GIB
    )


async def run_sized(queue: JobQueue, worker: str, jobs: list[JobSpec]) -> list[Lease]:
    """`worker` (4 GPUs, 4 CPUs, 16 GiB) claims and runs `jobs`, one claim each, in order."""
    leases: list[Lease] = []
    for job in jobs:
        await queue.enqueue(job)
        held = [lease.spec for lease in leases]
        free = room(
            4 - sum(s.gpus for s in held), 4 - sum(s.cpus for s in held), 16 * GIB - sum(s.mem for s in held)
        )
        (lease,) = await queue.claim_many(worker, ["default"], 1, free)
        leases.append(lease)
    return leases


async def test_a_priority_job_waiting_for_cpus_or_memory_stops_the_jobs_that_hold_them(
    redis: AnyRedis,
) -> None:
    """issue 50 review: preemption counted GPUs alone, so a priority job whose GPUs were free but
    whose CPUs and memory lower jobs held stopped nobody and waited behind them for ever. It stops
    the job holding the CPUs and the one holding the memory, and not the latest started, which
    holds only a GPU it does not need."""
    queue = JobQueue(redis, lease_seconds=30, preempt=["default"])
    running = await run_sized(
        queue, "w1", [sized("cpus", 1, cpus=3), sized("memory", 1, mem=8 * GIB), sized("gpu", 1)]
    )
    urgent, _ = await queue.enqueue(sized("urgent", 1, cpus=2, mem=12 * GIB, priority=5))
    assert await queue.claim_many("w1", ["default"], 1, room(1, 1, 8 * GIB)) == []
    assert await statuses(queue, "w1", running) == [RenewStatus.PREEMPT, RenewStatus.PREEMPT, RenewStatus.OK]
    for lease in running[:2]:
        assert await queue.hand_back(lease) is JobState.QUEUED
    got = await queue.claim_many("w1", ["default"], 1, room(3, 4, 16 * GIB))
    assert [lease.job_id for lease in got] == [urgent]


async def test_a_priority_job_stops_enough_for_its_gpus_and_its_cpus_together(redis: AnyRedis) -> None:
    """issue 50 review: the victims were chosen to free GPUs alone, so a job needing 3 GPUs and 4
    CPUs stopped the 2-GPU job and not the one holding the CPUs: it could not start after all."""
    queue = JobQueue(redis, lease_seconds=30, preempt=["default"])
    running = await run_sized(queue, "w1", [sized("cpus", 1, cpus=3), sized("gpus", 2)])
    await queue.enqueue(sized("urgent", 3, cpus=4, priority=5))
    assert await queue.claim_many("w1", ["default"], 1, room(1, 1, 16 * GIB)) == []
    assert await statuses(queue, "w1", running) == [RenewStatus.PREEMPT, RenewStatus.PREEMPT]


async def test_a_full_worker_asked_for_a_slot_stops_the_job_that_holds_the_cpus(redis: AnyRedis) -> None:
    """issue 50 review: with every slot taken, the job stopped for a slot was the latest started,
    whatever it held, so a priority job needing CPUs got a slot and still could not start."""
    queue = JobQueue(redis, lease_seconds=30, preempt=["default"])
    running = await run_sized(queue, "w1", [sized("cpus", 1, cpus=3), sized("gpu", 1)])
    await queue.enqueue(sized("urgent", 1, cpus=2, priority=5))
    assert await queue.preempt_check("w1", ["default"], room(2, 1, 16 * GIB))
    assert await statuses(queue, "w1", running) == [RenewStatus.PREEMPT, RenewStatus.OK]


async def test_a_lower_priority_job_the_room_does_not_need_runs_on(redis: AnyRedis) -> None:
    """issue 50 review, pinned: the jobs are taken in order (the lowest priority first) while
    something is still short, then any not needed is left running, the last taken first. Beside
    B (priority 3, 2 GPUs) and A (priority 1, 1 GPU), with 1 GPU free, a job needing 3 takes A,
    then B; B alone frees enough, so A (the lower priority) runs on and B alone is stopped:
    none is stopped for nothing."""
    queue = JobQueue(redis, lease_seconds=30, preempt=["default"])
    b, a = await fill(queue, "w1", [spec(0, 2, priority=3), spec(1, 1, priority=1)])
    await queue.enqueue(spec(9, 3, priority=5))
    assert await queue.claim_many("w1", ["default"], 1, Capacity(1, gpus_total=4, ends=[(None, 3)])) == []
    assert await statuses(queue, "w1", [b, a]) == [RenewStatus.PREEMPT, RenewStatus.OK]
