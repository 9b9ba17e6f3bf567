"""issue 46: a JobQueue with the GPU-less fast path off (`fast_path=False`) makes every call
through plain redis-py (scripts.PlainCalls, PlainTransport), on one redis-server and on a Redis
Cluster: the queue works whole, a script Redis forgot is loaded again, a durable write still
waits for its replicas, and no claim is left standing. The fast path's own transport is broken
on purpose meanwhile (`break_fast_transport`), so a call that reached it would fail the test."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from daemon.errors import NotReplicated
from daemon.job import JobSpec, JobState, Outcome
from daemon.queue import fast_path
from daemon.queue.connection import AnyRedis
from daemon.queue.job_queue import JobQueue
from daemon.queue.scripts import ReplicaAck


def break_fast_transport(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The fast path's transport and auto-pipelining made to fail, loudly, if anything calls
    them: what a test with the switch off proves it never used. Returns what was called."""
    called: list[str] = []

    def broken(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            called.append(name)
            raise AssertionError(f"{name} was called with the fast path off")

        return call

    for owner, name in (
        (fast_path.FastTransport, "exchange"),
        (fast_path.FastTransport, "exchange_on"),
        (fast_path.Pipeliner, "submit"),
    ):
        monkeypatch.setattr(owner, name, broken(f"{owner.__name__}.{name}"))
    return called


def spec(n: int) -> JobSpec:
    return JobSpec(argv=("echo", str(n)))


async def test_with_the_fast_path_off_the_queue_works_through_plain_redis_py(
    either_redis: AnyRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 46: enqueue, enqueue_many, claims, completes, cancel and reclaim through plain
    redis-py, FIFO as ever; a script flushed from Redis meanwhile is loaded again; no claim stands."""
    called = break_fast_transport(monkeypatch)
    queue = JobQueue(either_redis, lease_seconds=30, fast_path=False)
    assert queue.stand("w", ["default"], 1) is None
    ids = [(await queue.enqueue(spec(n)))[0] for n in range(3)]
    ids += await queue.enqueue_many([spec(n) for n in range(3, 6)])
    leases = await queue.claim_many("w", ["default"], 4)
    assert [lease.job_id for lease in leases] == ids[:4]
    for lease in leases:
        assert await queue.complete(lease, Outcome(JobState.SUCCEEDED, 0, "")) is JobState.SUCCEEDED
    assert await queue.cancel(ids[4]) == "cancelled"
    await either_redis.script_flush()  # Redis forgot every script: NOSCRIPT, loaded, sent again
    last = await queue.claim("w", ["default"])
    assert last is not None
    assert last.job_id == ids[5]
    assert await queue.reclaim() == []
    assert (await queue.get(ids[5])).state is JobState.RUNNING
    assert called == []


async def test_with_the_fast_path_off_a_durable_write_still_waits_for_its_replicas(
    redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 46: the plain path's batch ends with its WAIT on the same connection as its writes,
    as the fast path's does: on a Redis with no replica, an enqueue asked to reach one is not
    acknowledged (NotReplicated) though it was written."""
    called = break_fast_transport(monkeypatch)
    queue = JobQueue(redis, ack=ReplicaAck(1, 50), fast_path=False)
    with pytest.raises(NotReplicated):
        await queue.enqueue(spec(1))
    assert await JobQueue(redis, fast_path=False).claim("w", ["default"]) is not None
    assert called == []
