"""A pilot's claims (claim.lua's `lifetime`): a worker with an end never claims a job that could run
past it, by any path a claim takes (the stream, the front, the priorities, fair share's lines,
backfill behind a head, preemption and the reservation it leaves): neither a job whose time limit
and stop grace end later, nor one with no time limit at all. Such a job stays queued, waits for no
pilot, and a worker without an end takes it. Against one redis-server and a Redis Cluster."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from daemon.job import JobSpec, JobState, Lease, Outcome, RenewStatus
from daemon.queue import keys
from daemon.queue.claims import Capacity
from daemon.queue.connection import AnyRedis
from daemon.queue.job_queue import JobQueue

LEFT = 50.0  # seconds the pilot has left
OK = Outcome(JobState.SUCCEEDED, exit_code=0)


@pytest.fixture
def redis(either_redis: AnyRedis) -> AnyRedis:
    return either_redis


def job(n: int, timeout: float | None = None, **kw: object) -> JobSpec:
    return JobSpec(argv=("echo", str(n)), timeout=timeout, stop_grace=1, **kw)  # type: ignore[arg-type]


# How the job that must not go to the pilot waits: (the queue, the outliving job's id, the id of
# a job that fits, the pilot's claim arguments). `limit` is the outliving job's time limit.
Placed = tuple[JobQueue, str, str, dict[str, object]]
# `owners`: the users of the two jobs (the one passed over, the one that fits).
Setup = Callable[..., Awaitable[Placed]]
ANYONE = ("", "")


async def in_the_stream(redis: AnyRedis, limit: float | None, owners: tuple[str, str] = ANYONE) -> Placed:
    """A CPU worker's claim: the path that takes entries without a look first, on a worker with no end."""
    queue = JobQueue(redis, lease_seconds=30)
    outlives, fits = await queue.enqueue_many([job(0, limit, user=owners[0]), job(1, 10, user=owners[1])])
    return queue, outlives, fits, {}


async def in_the_stream_with_gpus(
    redis: AnyRedis, limit: float | None, owners: tuple[str, str] = ANYONE
) -> Placed:
    queue = JobQueue(redis, lease_seconds=30)
    outlives, fits = await queue.enqueue_many(
        [job(0, limit, gpus=1, user=owners[0]), job(1, 10, gpus=1, user=owners[1])]
    )
    return queue, outlives, fits, {"gpus_free": 4, "gpus_total": 4}


async def at_the_front(redis: AnyRedis, limit: float | None, owners: tuple[str, str] = ANYONE) -> Placed:
    queue = JobQueue(redis, lease_seconds=30)
    (outlives,) = await queue.enqueue_many([job(0, limit, user=owners[0])])
    (lease,) = await queue.claim_many("w0", ["default"], 1)
    assert await queue.hand_back(lease) is JobState.QUEUED  # handed back: at the front
    (fits,) = await queue.enqueue_many([job(1, 10, user=owners[1])])
    return queue, outlives, fits, {}


async def with_a_priority(redis: AnyRedis, limit: float | None, owners: tuple[str, str] = ANYONE) -> Placed:
    queue = JobQueue(redis, lease_seconds=30)
    outlives, fits = await queue.enqueue_many(
        [job(0, limit, priority=5, user=owners[0]), job(1, 10, user=owners[1])]
    )
    return queue, outlives, fits, {}


async def in_a_users_line(
    redis: AnyRedis, limit: float | None, owners: tuple[str, str] = ("ann", "bob")
) -> Placed:
    queue = JobQueue(redis, lease_seconds=30, fairshare=["default"], fairshare_half_life=3600)
    outlives, fits = await queue.enqueue_many([job(0, limit, user=owners[0]), job(1, 10, user=owners[1])])
    return queue, outlives, fits, {}


async def behind_a_head(redis: AnyRedis, limit: float | None, owners: tuple[str, str] = ANYONE) -> Placed:
    """Backfill: the head waits for 4 GPUs, reserved on w2; the pilot, with 2 free, may backfill."""
    queue = JobQueue(redis, lease_seconds=30)
    jobs = [job(0, 10, gpus=4), job(1, limit, gpus=1, user=owners[0]), job(2, 10, gpus=1, user=owners[1])]
    _, outlives, fits = await queue.enqueue_many(jobs)
    assert (
        await queue.claim_many("w2", ["default"], 1, Capacity(2, gpus_total=4, ends=[(None, 2)], grace=1))
        == []
    )
    assert (await redis.hget(keys.reservation("default"), "worker")) == b"w2"
    return queue, outlives, fits, {"gpus_free": 2, "gpus_total": 4, "ends": [(None, 2)], "grace": 1}


@pytest.mark.parametrize("limit", [None, 100.0], ids=["no time limit", "a time limit past its end"])
@pytest.mark.parametrize(
    "setup",
    [in_the_stream, in_the_stream_with_gpus, at_the_front, with_a_priority, in_a_users_line, behind_a_head],
    ids=["stream", "stream, GPUs", "front", "priority", "fair share", "backfill"],
)
async def test_a_pilot_passes_over_a_job_that_could_outlive_it_on_every_claim_path(
    redis: AnyRedis, setup: Setup, limit: float | None
) -> None:
    """issue 43 item 5: a pilot claimed a job without --timeout, which then ran into its end; one
    whose time limit (plus stop grace) runs past the pilot's end was passed over already. Neither
    is claimed now; the job behind goes, and a worker without an end takes the one passed over."""
    queue, outlives, fits, room = await setup(redis, limit)
    before = await queue.get(outlives)
    got = await queue.claim_many("pilot", ["default"], 2, Capacity(lifetime=LEFT, **room))  # type: ignore[arg-type]
    assert [lease.job_id for lease in got] == [fits]
    after = await queue.get(outlives)
    assert (after.state, after.attempt) == (JobState.QUEUED, before.attempt)
    for lease in got:
        await queue.complete(lease, OK)
    if setup is behind_a_head:
        room = {"gpus_free": 8, "gpus_total": 8}  # room for the head too, which goes first
    else:
        room = {k: v for k, v in room.items() if k.startswith("gpus")}
    got = await queue.claim_many("w9", ["default"], 3, Capacity(**room))  # type: ignore[arg-type]
    assert outlives in [lease.job_id for lease in got]


@pytest.mark.parametrize(
    "setup",
    [in_the_stream, in_the_stream_with_gpus, at_the_front, with_a_priority, in_a_users_line, behind_a_head],
    ids=["stream", "stream, GPUs", "front", "priority", "fair share", "backfill"],
)
async def test_one_users_worker_passes_over_another_users_job_on_every_claim_path(
    redis: AnyRedis, setup: Setup
) -> None:
    """issue 44 item 1: a worker that does not run as root runs every job as its own user, who can
    read its config (the pool's credentials): it serves one pool user (`serve_user`). Bob's job,
    ahead of Alice's on each path a claim takes, is never claimed by Alice's worker, and does not
    hold hers back; a worker serving everyone then takes Bob's."""
    queue, bobs, alices, room = await setup(redis, 10.0, ("bob", "alice"))
    before = await queue.get(bobs)
    queue.serve_user = "alice"  # as JobQueue.from_config sets it from worker_serve_user
    got = await queue.claim_many("alices", ["default"], 2, Capacity(**room))  # type: ignore[arg-type]
    assert [lease.job_id for lease in got] == [alices]
    after = await queue.get(bobs)
    assert (after.state, after.attempt) == (JobState.QUEUED, before.attempt)
    for lease in got:
        await queue.complete(lease, OK)
    queue.serve_user = ""
    if setup is behind_a_head:
        room = {"gpus_free": 8, "gpus_total": 8}
    else:
        room = {k: v for k, v in room.items() if k.startswith("gpus")}
    got = await queue.claim_many("w9", ["default"], 3, Capacity(**room))  # type: ignore[arg-type]
    assert bobs in [lease.job_id for lease in got]


async def running(queue: JobQueue, worker: str, specs: list[JobSpec], gpus: int) -> list[Lease]:
    """`worker` (`gpus` GPUs) claims and runs `specs`, one claim each, in order."""
    leases: list[Lease] = []
    for spec in specs:
        await queue.enqueue(spec)
        free = gpus - sum(lease.spec.gpus for lease in leases)
        (lease,) = await queue.claim_many(worker, ["default"], 1, Capacity(free, gpus_total=gpus))
        leases.append(lease)
    return leases


@pytest.mark.parametrize(("limit", "preempts"), [(None, False), (100.0, False), (10.0, True)])
async def test_a_full_pilot_preempts_nothing_for_a_job_that_could_outlive_it(
    redis: AnyRedis, limit: float | None, preempts: bool
) -> None:
    """issue 43 item 5: the check a full worker makes (a claim for no job) did not say the pilot's
    end, so a pilot stopped its own jobs for a priority job it could not run to its end."""
    queue = JobQueue(redis, lease_seconds=30, preempt=["default"])
    low = await running(queue, "pilot", [job(0, 10, gpus=1), job(1, 10, gpus=1)], gpus=4)
    await queue.enqueue(job(9, limit, gpus=1, priority=5))
    asked = await queue.preempt_check("pilot", ["default"], Capacity(2, 0, gpus_total=4, lifetime=LEFT))
    assert asked is preempts
    got = await queue.renew("pilot", low)
    want = [RenewStatus.OK, RenewStatus.PREEMPT if preempts else RenewStatus.OK]
    assert [got[lease.id] for lease in low] == want


async def test_a_pilot_keeps_no_gpus_for_a_job_it_preempted_for_once_it_no_longer_fits(
    redis: AnyRedis,
) -> None:
    """issue 43 item 5: a job a pilot preempted for, which no longer fits the time the pilot has
    left when its GPUs are free, is not started there; nor are the pilot's GPUs kept for it from
    its later queues (its reservation is dropped): they go to what fits."""
    queue = JobQueue(redis, lease_seconds=30, preempt=["default"])
    (low,) = await running(queue, "pilot", [job(0, 10, gpus=2)], gpus=2)
    urgent, _ = await queue.enqueue(job(9, 20, gpus=2, priority=5))
    assert await queue.preempt_check("pilot", ["default"], Capacity(0, 0, gpus_total=2, lifetime=LEFT))
    assert (await queue.renew("pilot", [low]))[low.id] is RenewStatus.PREEMPT
    await queue.complete(low, OK)  # it ended meanwhile
    spare, _ = await queue.enqueue(job(5, 2, gpus=1, queue="spare"))
    # 15 s left: the urgent job (20 s) no longer fits; the spare queue's (2 s) does
    got = await queue.claim_many(
        "pilot", ["default", "spare"], 1, Capacity(2, gpus_total=2, grace=1, lifetime=15)
    )
    assert [lease.job_id for lease in got] == [spare]
    assert await redis.hget(keys.reservation("default"), "worker") != b"pilot"
    assert (await queue.get(urgent)).state is JobState.QUEUED
    got = await queue.claim_many("w9", ["default"], 1, Capacity(2, gpus_total=2))
    assert [lease.job_id for lease in got] == [urgent]
