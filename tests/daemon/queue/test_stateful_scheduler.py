"""The scheduler checked by a model (issue 46): tests/support/scheduler_model.py's state machine,
random enqueues, claims, completes, cancels, requeues, hand-backs and reclaims under caps, fair
share, preemption and backfill drawn per example, on a real redis-server, its invariants checked
after every step. Bounded here (make test); tests/chaos/test_stateful_scheduler.py runs it longer
(make chaos)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, Phase, settings
from redis.asyncio import Redis

from daemon.job import JobSpec, JobState, Outcome
from daemon.queue import keys
from daemon.queue.claims import Capacity
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from tests.support.scheduler_model import STATS, run_machine

# Derandomized, with no example database: every run of `make test` draws the same examples.
BOUNDED = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
    # No explain phase: it reruns a failing example at length, after the shrink that says more.
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
)


@pytest.mark.timeout(300)  # a passing run takes ~13 s; a failing one shrinks its steps, longer
def test_stateful_scheduler_keeps_its_invariants(redis_server: EmbeddedRedis) -> None:
    """Issue 46: after every step of random work on the queue, every job not ended is in exactly
    one place, no worker holds more than it has, no user runs over the caps, FIFO holds within
    a user, a priority and a size, a reserved head starts once its worker has its GPUs, and every
    job ends exactly once (tests/support/scheduler_model.py says each exactly)."""
    STATS.clear()
    began = time.monotonic()
    run_machine(redis_server, BOUNDED)
    print(f"stateful: {dict(STATS)} in {time.monotonic() - began:.1f} s")


# -- what the model found, each shrunk to a plain test ---------------------------------------------


async def test_a_parked_job_does_not_pass_an_older_one_of_its_user_in_a_fair_share_line(redis: Redis) -> None:
    """Issue 46: FIFO within one user in a fair-share queue (docs/GUARANTEES.md §4). A claim reads
    the stream's new entries into their users' lines; one by a worker too small for a job parks
    it instead. A later claim by a big worker serves `parked` with the front, before every line,
    so alice's job enqueued last starts before her older ones of the same size still in her line."""
    queue = JobQueue(redis, lease_seconds=300, fairshare=["default"], fairshare_half_life=3600.0)
    first, older, oldest_waiting = await queue.enqueue_many([two_gpus("alice")] * 3)
    # A worker of 2 GPUs takes the first; the claim read the others into alice's line.
    assert await claimed(queue, "two", count=1, gpus=2) == [first]
    (newest,) = await queue.enqueue_many([two_gpus("alice")])
    # A worker without GPUs passes the newest over: parked, for a worker big enough.
    assert await claimed(queue, "none", count=1, gpus=0) == []
    # A worker of 4 GPUs: alice's jobs start in the order she enqueued them.
    assert await claimed(queue, "four", count=2, gpus=4) == [older, oldest_waiting]
    assert (await queue.get(newest)).state is JobState.QUEUED


OK = Outcome(JobState.SUCCEEDED, exit_code=0)


def two_gpus(user: str) -> JobSpec:
    return JobSpec(argv=("true",), user=user, gpus=2)


async def claimed(
    queue: JobQueue, worker: str, *, count: int, gpus: int, ends: Sequence[tuple[float | None, int]] = ()
) -> list[str]:
    """What `worker` claims with `gpus` free; `ends`, when its running jobs (of the GPUs it has
    beyond those) end at the latest."""
    total = gpus + sum(g for _t, g in ends)
    leases = await queue.claim_many(
        worker, ["default"], count, Capacity(gpus, gpus_total=total, ends=ends, grace=1)
    )
    return [lease.job_id for lease in leases]


async def test_a_job_held_from_the_front_goes_before_the_priorities_in_a_fair_share_queue(
    redis: Redis,
) -> None:
    """Issue 46: the front goes before the priorities, also in a fair-share queue "a job from the
    front held at its user's cap, too, once they are below it" (docs/GUARANTEES.md §4), and FIFO
    holds among one user's jobs of one priority. Here alice's older priority job, parked by a
    worker without GPUs, then held at her cap from the front, waits in her line marked 'front';
    once she is below the cap her newer job of the same priority and size starts first, from
    `prio`, which claim.lua serves before the users' lines."""
    queue = JobQueue(redis, lease_seconds=300, user_caps=(1, 0), fairshare=["default"])
    older, first = await queue.enqueue_many([one_gpu("alice", 10), JobSpec(argv=("true",), user="alice")])
    # A worker without GPUs parks the GPU job and starts alice's job that needs none.
    (running,) = await queue.claim_many("none", ["default"], 1, Capacity(0, gpus_total=0))
    assert running.job_id == first
    # A worker with GPUs finds the parked ones at the front, alice at her cap: held in her line.
    assert await claimed(queue, "two", count=1, gpus=2) == []
    (newer,) = await queue.enqueue_many([one_gpu("alice", 10)])
    await queue.complete(running, OK)
    assert await claimed(queue, "two", count=1, gpus=2) == [older]
    assert (await queue.get(newer)).state is JobState.QUEUED


def one_gpu(user: str, priority: int, timeout: float | None = None) -> JobSpec:
    return JobSpec(argv=("true",), user=user, gpus=1, priority=priority, timeout=timeout, stop_grace=1)


async def test_backfill_takes_the_front_in_enqueue_order(redis: Redis) -> None:
    """Issue 46: a job held at its user's cap goes back to the front "by its enqueue order", a job
    passed over waits "by its enqueue order among those", and among one user's jobs of one size
    it is FIFO (docs/GUARANTEES.md §4). The front of a claim merges the two by enqueue order; its
    backfill behind a waiting head takes every parked job first, so carol's job parked by a
    worker without GPUs starts before her older one of the same size released from her cap."""
    queue = JobQueue(redis, lease_seconds=300, user_caps=(2, 0))
    running, other = await queue.enqueue_many([one_gpu("carol", 0, 500)] * 2)
    assert await claimed(queue, "four", count=1, gpus=4) == [running]
    (elsewhere,) = await queue.claim_many("two", ["default"], 1, Capacity(2, gpus_total=2))
    assert elsewhere.job_id == other  # carol runs two jobs: at her cap
    head, older = await queue.enqueue_many(
        [JobSpec(argv=("true",), user="carol", gpus=4), one_gpu("carol", 0, 5)]
    )
    assert await claimed(queue, "four", count=2, gpus=3, ends=[(501, 1)]) == []  # both held at her cap
    (younger,) = await queue.enqueue_many([one_gpu("carol", 0, 5)])
    assert await claimed(queue, "none", count=1, gpus=0) == []  # parked: too big for a worker without GPUs
    await queue.complete(elsewhere, OK)  # carol below her cap: the head waits for the 4 GPUs
    assert await claimed(queue, "four", count=2, gpus=3, ends=[(501, 1)]) == [older]
    assert (await queue.get(head)).state is JobState.QUEUED
    assert (await queue.get(younger)).state is JobState.QUEUED


async def test_a_preempting_job_waits_out_its_retry_back_off(redis: Redis) -> None:
    """Issue 46: a failed job with retries left goes back to the front once its back-off is over
    (docs/GUARANTEES.md §4), and a job not ended is in exactly one place. Here a priority job
    reserves a worker and preempts there, starts elsewhere meanwhile, and fails: queued in
    `backoff` for 60 s, its preempting reservation still starts it on that worker at the next
    claim, and leaves it in `backoff` too, running."""
    queue = JobQueue(redis, lease_seconds=300, preempt=["default"], retry_backoff=(60.0, 60.0))
    (low,) = await queue.enqueue_many([one_gpu("alice", 0)])
    (preempted,) = await queue.claim_many("two", ["default"], 1, Capacity(2, gpus_total=2))
    assert preempted.job_id == low
    (high,) = await queue.enqueue_many(
        [JobSpec(argv=("true",), user="alice", gpus=2, priority=10, retries=1)]
    )
    # `high` waits for the 2 GPUs of "two", reserves them and preempts `low` there.
    assert await queue.claim_many("two", ["default"], 1, Capacity(1, gpus_total=2)) == []
    (elsewhere,) = await queue.claim_many("four", ["default"], 1, Capacity(4, gpus_total=4))
    assert elsewhere.job_id == high
    await queue.hand_back(preempted)  # handed back, as preempted
    assert await queue.complete(elsewhere, Outcome(JobState.FAILED, exit_code=1)) is JobState.QUEUED
    assert await claimed(queue, "two", count=2, gpus=2) == [low]
    assert await redis.zscore(keys.backoff("default"), high) is not None
