"""The pool's Redis as a Sentinel group, on real processes (tests/support/sentinel.py): a client
finds the primary through the sentinels and finds the promoted replica after the primary is
SIGKILLed; a submit or an outcome is acknowledged only once `redis_min_replicas_ack` replicas have
it, and one that is not says so and is safe to repeat."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import pytest
from redis.asyncio import Redis
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import RedisError

from daemon.address import parse_host_ports
from daemon.errors import NotReplicated
from daemon.job import JobSpec, JobState, Outcome
from daemon.queue.connection import RunIdWatch, connect_sentinel
from daemon.queue.job_queue import JobQueue
from daemon.queue.scripts import ReplicaAck
from tests.support.redis_group import Process
from tests.support.sentinel import MASTER, SentinelGroup
from tests.support.workers import running_worker, sh, wait_state

ACK = ReplicaAck(replicas=1, timeout_ms=300)
T = TypeVar("T")


@asynccontextmanager
async def sentinel_queue(
    group: SentinelGroup, ack: ReplicaAck | None = ACK, first: Process | None = None
) -> AsyncIterator[JobQueue]:
    """A JobQueue on the group's primary, through the sentinels, as a multinode poold makes it;
    `first`: the sentinel it asks first."""
    watch = RunIdWatch()
    addresses = sorted(group.sentinel_addresses, key=lambda a: first is None or a != first.address)
    redis, manager = connect_sentinel(
        parse_host_ports(addresses),
        MASTER,
        password=group.password,
        sentinel_password=group.sentinel_password,
        watch=watch,
    )
    try:
        yield JobQueue(redis, lease_seconds=30, watch=watch, ack=ack)
    finally:
        await redis.aclose()
        await manager.aclose()


async def answered(call: Callable[[], Awaitable[T]], seconds: float = 20) -> T:
    """`call`'s answer, made again while it fails as Redis being away or a write not yet on a
    replica fail (as a worker's next beat or claim, or a client with its idempotency key, would)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return await call()
        except (RedisError, NotReplicated):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_acknowledged_jobs_survive_the_primarys_death_and_the_client_finds_the_new_one(
    sentinel_group_of_three: SentinelGroup,
) -> None:
    sentinel_group = sentinel_group_of_three
    async with sentinel_queue(sentinel_group) as queue:
        ids = [(await queue.enqueue(JobSpec(argv=("true",))))[0] for _ in range(20)]
        ids += await queue.enqueue_many([JobSpec(argv=("true",))] * 20)
        assert queue.watch is not None
        seen = queue.watch.generation
        old = sentinel_group.primary()
        sentinel_group.kill(old)  # after every acknowledged write, before anything else
        started = time.monotonic()
        new = await asyncio.to_thread(sentinel_group.wait_failover, old)
        assert new.port != old.port
        # The same client, unchanged: it finds the promoted replica by itself, once the sentinels
        # have settled (until then a call fails, as Redis being away does, and is made again).
        await answered(lambda: queue.get(ids[0]))
        for job_id in ids:
            assert (await queue.get(job_id)).state is JobState.QUEUED
        assert queue.watch.generation > seen  # another redis-server answers: leases re-validated
        # The other replica follows the new primary once the sentinels tell it to and it has
        # synced; until then a submit is not acknowledged, and repeating it (same key) is safe.
        later, _ = await answered(lambda: queue.enqueue(JobSpec(argv=("true",)), idempotency_key="after"))
        assert (await queue.get(later)).state is JobState.QUEUED
        print(f"failover: {time.monotonic() - started:.2f} s from SIGKILL to the promoted replica")


async def test_a_write_no_replica_confirms_is_not_acknowledged_and_repeating_it_is_safe(
    sentinel_group: SentinelGroup,
) -> None:
    replica = next(n for n in sentinel_group.nodes if n is not sentinel_group.primary())
    assert replica.proc is not None
    spec = JobSpec(argv=("true",))
    async with sentinel_queue(sentinel_group) as queue, sentinel_queue(sentinel_group) as other:
        os.kill(replica.proc.pid, signal.SIGSTOP)  # alive to the primary, but it acknowledges nothing
        try:
            with pytest.raises(NotReplicated, match="only 0 of the 1 replicas") as refused:
                await queue.enqueue(spec, idempotency_key="k1")
            assert "--key" in str(refused.value)
            # The same submit again, from another client (new connections, which wrote nothing
            # yet): the job it finds is still not on the replica, so still not acknowledged.
            with pytest.raises(NotReplicated):
                await other.enqueue(spec, idempotency_key="k1")
            with pytest.raises(NotReplicated):
                await other.enqueue_many([spec])
        finally:
            os.kill(replica.proc.pid, signal.SIGCONT)
        job_id, created = await other.enqueue(spec, idempotency_key="k1")  # now it is
        assert not created  # the first submit's job, kept all along
        assert (await queue.get(job_id)).state is JobState.QUEUED


async def test_an_outcome_no_replica_confirms_is_refused_and_recorded_once_when_repeated(
    sentinel_group: SentinelGroup,
) -> None:
    replica = next(n for n in sentinel_group.nodes if n is not sentinel_group.primary())
    assert replica.proc is not None
    async with sentinel_queue(sentinel_group) as queue, sentinel_queue(sentinel_group) as other:
        job_id, _ = await queue.enqueue(JobSpec(argv=("true",)))
        lease = await queue.claim("w1", ["default"])
        assert lease is not None
        assert lease.job_id == job_id
        outcome = Outcome(JobState.SUCCEEDED, 0, "", {})
        os.kill(replica.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(NotReplicated):
                await queue.complete(lease, outcome)
            with pytest.raises(NotReplicated):  # answered as before, still not on the replica
                await other.complete(lease, outcome)
        finally:
            os.kill(replica.proc.pid, signal.SIGCONT)
        assert await other.complete(lease, outcome) is JobState.SUCCEEDED
        info = await queue.get(job_id)
        assert info.state is JobState.SUCCEEDED
        assert [(a.attempt, a.how) for a in info.attempts] == [(1, "succeeded")]


async def test_without_replicas_asked_for_the_primarys_word_is_enough(sentinel_group: SentinelGroup) -> None:
    replica = next(n for n in sentinel_group.nodes if n is not sentinel_group.primary())
    assert replica.proc is not None
    async with sentinel_queue(sentinel_group, ack=None) as queue:
        os.kill(replica.proc.pid, signal.SIGSTOP)
        try:
            job_id, _ = await queue.enqueue(JobSpec(argv=("true",)))
        finally:
            os.kill(replica.proc.pid, signal.SIGCONT)
        assert (await queue.get(job_id)).state is JobState.QUEUED


async def test_a_client_sent_to_a_replica_leaves_it_for_the_primary(sentinel_group: SentinelGroup) -> None:
    """The race of a failover: a sentinel names the primary, which is demoted (its clients killed)
    before this client's connection reaches it, so the connection is to a replica. Its script's
    write is refused (READONLY inside the script's error, which redis-py does not take for a
    demotion), and the client must drop that connection and ask the sentinels again, rather than
    keep it and fail every call on it from then on. The stale answer is injected at discovery,
    once; the servers and the refusal are real."""
    replica = next(n for n in sentinel_group.nodes if n is not sentinel_group.primary())
    async with sentinel_queue(sentinel_group) as queue:
        assert isinstance(queue.redis, Redis)
        pool = queue.redis.connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        manager = pool.sentinel_manager
        discover, stale = manager.discover_master, [("127.0.0.1", replica.port)]

        async def racing(service: str) -> tuple[str, int]:
            return stale.pop() if stale else await discover(service)

        manager.discover_master = racing
        job_id, _ = await queue.enqueue(JobSpec(argv=("true",)))
        assert not stale  # it did reach the replica first
        assert (await queue.get(job_id)).state is JobState.QUEUED
        info = await queue.redis.info("replication")
        assert info["role"] == "master"


async def test_a_promoted_replica_is_new_to_the_pool_however_long_it_has_run(
    sentinel_group: SentinelGroup,
) -> None:
    """A worker that starts just after a failover must pause its claims as after a restart
    (claim_gate.py): the age it is told is the time since the pool first met this primary, not the
    promoted replica's uptime."""
    async with sentinel_queue(sentinel_group) as queue:
        assert await queue.primary_age(["default"]) > 3600  # a new Redis: it never held what a worker runs
        # its record on the replica before the kill (killed at once, the replica, promoted, had
        # none: "never held the pool's data", as old as time; a fresh-clone run saw it once)
        assert await queue.redis.wait(1, 5000) >= 1
        old = sentinel_group.primary()
        sentinel_group.kill(old)
        await asyncio.to_thread(sentinel_group.wait_failover, old)
        assert await queue.primary_age(["default"]) == 0  # up for seconds, the pool's for no time at all
        assert queue.watch is not None
        assert queue.watch.run_id is not None
        await asyncio.sleep(0.3)
        assert 0.2 <= await queue.primary_age(["default"]) < 1.2


async def test_a_worker_starts_no_job_whose_claim_no_replica_has(
    sentinel_group: SentinelGroup, tmp_path: Path
) -> None:
    """With `redis_min_replicas_ack`, a claim counts once a replica has it: while the only replica
    is frozen, the worker's claims are not confirmed and it starts nothing (a primary cut off from
    its replicas grants nothing: another worker may be given the job by the one promoted). Once
    the replica answers, the same claim, sent again by its request number, starts the job, once."""
    replica = next(n for n in sentinel_group.nodes if n is not sentinel_group.primary())
    assert replica.proc is not None
    ran = tmp_path / "ran"
    async with sentinel_queue(sentinel_group, ack=None) as submit:
        job_id, _ = await submit.enqueue(sh(f"echo $GPUPOOL_ATTEMPT_ID >> {ran}"))
    async with (
        sentinel_queue(sentinel_group) as queue,
        running_worker(queue, tmp_path / "w", heartbeat_seconds=0.3),
    ):
        os.kill(replica.proc.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(2.0)  # several claims and beats, none confirmed
            assert not ran.exists()
        finally:  # before the worker stops: it would wait for its outcomes to be confirmed
            os.kill(replica.proc.pid, signal.SIGCONT)
        info = await wait_state(queue, job_id, JobState.SUCCEEDED)
    assert len(ran.read_text().split()) == 1  # it ran once
    assert [(a.attempt, a.how) for a in info.attempts] == [(1, "succeeded")]
