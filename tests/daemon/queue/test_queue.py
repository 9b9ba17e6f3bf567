"""The queue's guarantees (docs/DESIGN.md §6), each against a real redis-server, each able to fail;
and each (but the one that kills the server) against a real Redis Cluster of three primaries as
well (tests/support/cluster.py), where every queue lives on the shard of its slot."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from daemon.aio import cancel_and_wait
from daemon.errors import (
    IdempotencyConflict,
    InvalidJob,
    JobNotFound,
    StaleAttempt,
    TooManyUnended,
    TooMuchStored,
)
from daemon.job import JobSpec, JobState, Lease, Outcome, RenewStatus, new_job_id, queue_of
from daemon.queue import keys
from daemon.queue.claims import Capacity
from daemon.queue.connection import AnyRedis
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from tests.daemon.queue.conftest import Server
from tests.support.faults import memory_full

OK = Outcome(JobState.SUCCEEDED, exit_code=0)


@pytest.fixture
def redis(either_redis: AnyRedis) -> AnyRedis:
    """Each test here runs on one redis-server and on a Redis Cluster (conftest.py)."""
    return either_redis


def spec(n: int = 0, **kw: object) -> JobSpec:
    return JobSpec(argv=("echo", str(n)), **kw)  # type: ignore[arg-type]


async def claim(
    queue: JobQueue, worker: str = "w1", queues: tuple[str, ...] = ("default",), gpus: int = 0
) -> Lease:
    lease = await queue.claim(worker, queues, Capacity(gpus))
    assert lease is not None
    return lease


async def expire(queue: JobQueue, redis: AnyRedis, lease: Lease) -> None:
    """Make a lease's deadline pass now (as a silent worker would) and run the reaper."""
    await redis.zadd(keys.leases(lease.queue), {lease.job_id: 0})
    reclaimed = await queue.reclaim()
    assert (lease.job_id, JobState.QUEUED) in reclaimed


async def test_enqueue_claim_complete_records_everything(queue: JobQueue) -> None:
    job_id, created = await queue.enqueue(spec(1, name="hello", env={"A": "1"}))
    assert created
    assert job_id.startswith("default.")
    info = await queue.get(job_id)
    assert info.state is JobState.QUEUED
    assert info.attempt == 0
    assert info.spec.env == {"A": "1"}

    lease = await claim(queue)
    assert (lease.job_id, lease.attempt, lease.spec.name) == (job_id, 1, "hello")
    assert (await queue.get(job_id)).state is JobState.RUNNING

    state = await queue.complete(
        lease, Outcome(JobState.FAILED, exit_code=3, detail="exit 3", result={"rss": 5})
    )
    assert state is JobState.FAILED
    info = await queue.get(job_id)
    assert (info.state, info.exit_code, info.detail, info.worker) == (JobState.FAILED, 3, "exit 3", "w1")
    assert info.result == {"rss": 5}
    assert info.ended_at is not None
    assert info.started_at is not None
    assert [(a.attempt, a.worker, a.how) for a in info.attempts] == [(1, "w1", "failed")]
    assert await queue.claim("w1", ["default"]) is None


async def test_fifo_within_a_queue(queue: JobQueue) -> None:
    ids = [(await queue.enqueue(spec(i)))[0] for i in range(50)]
    claimed = [(await claim(queue, f"w{i % 3}")).job_id for i in range(50)]
    assert claimed == ids


async def test_reclaimed_attempt_goes_before_every_job_not_started(queue: JobQueue, redis: AnyRedis) -> None:
    a, b, c = [(await queue.enqueue(spec(i)))[0] for i in range(3)]
    lease_a = await claim(queue, "dead-worker")
    lease_b = await claim(queue, "dead-worker")
    await expire(queue, redis, lease_b)
    await expire(queue, redis, lease_a)  # reclaimed in the other order: still served in enqueue order
    order = [await claim(queue, "w2") for _ in range(3)]
    assert [(lease.job_id, lease.attempt) for lease in order] == [(a, 2), (b, 2), (c, 1)]
    history = (await queue.get(a)).attempts
    assert [(h.attempt, h.worker, h.how) for h in history] == [
        (1, "dead-worker", "lost"),
        (2, "w2", "running"),
    ]


async def test_every_job_claimed_once_under_concurrent_claimers(queue: JobQueue, server: Server) -> None:
    total = 2000
    ids = set(await queue.enqueue_many([spec(i) for i in range(total)]))
    assert len(ids) == total
    claims: list[tuple[str, str]] = []

    async def consumer(name: str) -> None:
        # each consumer on its own connection pool, as separate workers would be
        client = server.client()
        q = JobQueue(client, lease_seconds=30)
        while (lease := await q.claim(name, ["default"])) is not None:
            claims.append((lease.job_id, name))
            await q.complete(lease, OK)
        await client.aclose()

    await asyncio.gather(*(consumer(f"c{i}") for i in range(8)))
    claimed_ids = [job_id for job_id, _ in claims]
    assert len(claimed_ids) == total
    assert set(claimed_ids) == ids
    assert len({name for _, name in claims}) > 1  # they really competed
    assert await queue.depth("default") == 0


async def test_enqueue_of_an_id_that_exists_makes_it_unique_and_a_resent_call_adds_nothing(
    queue: JobQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken, _ = await queue.enqueue(spec(0))
    monkeypatch.setattr("daemon.queue.job_queue.new_job_id", lambda q: taken)  # drawn in the same ms
    got, created = await queue.enqueue(spec(1))
    assert (got, created) == (taken + "z1", True)
    assert (await queue.get(taken)).spec.argv == ("echo", "0")  # untouched
    assert (await queue.get(got)).spec.argv == ("echo", "1")
    # the same call sent again (same drawn id, same spec: its reply was lost) answers the same job
    assert await queue.enqueue(spec(1)) == (got, True)
    assert await queue.depth("default") == 2


async def test_enqueue_many_keeps_order_per_queue_even_when_an_id_collides(
    queue: JobQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken, _ = await queue.enqueue(spec(0, queue="a"))
    draws = iter([taken])  # the batch's first id is one that exists (two drawn in one ms)
    monkeypatch.setattr("daemon.queue.job_queue.new_job_id", lambda q: next(draws, None) or new_job_id(q))
    mixed = [spec(i, queue="a" if i % 3 else "b") for i in range(1, 251)]  # chunks of 100 and runs
    ids = await queue.enqueue_many(mixed)
    assert len(set(ids)) == 250
    assert taken not in ids
    assert ids[0] == taken + "z1"  # made unique where it was drawn, so the batch kept its order
    assert (await queue.get(taken)).spec.argv == ("echo", "0")  # untouched
    assert (await queue.claim("w0", ["a"])).job_id == taken  # type: ignore[union-attr]
    for name in ("a", "b"):
        want = [i for i, s in zip(ids, mixed, strict=True) if s.queue == name]
        got = await queue.claim_many("w1", [name], 300)
        assert [lease.job_id for lease in got] == want
        assert [lease.spec.argv for lease in got] == [s.argv for s in mixed if s.queue == name]


async def test_claim_many_takes_reclaimed_then_stream_order_across_queues(
    queue: JobQueue, redis: AnyRedis
) -> None:
    a, b, c, d = [(await queue.enqueue(spec(i)))[0] for i in range(4)]
    dropped, _ = await queue.enqueue(spec())
    e, _ = await queue.enqueue(spec())
    low, _ = await queue.enqueue(spec(queue="low"))
    lease_b = await claim(queue, "dead-worker")  # a
    assert lease_b.job_id == a
    await expire(queue, redis, lease_b)
    await queue.cancel(dropped)
    first = await queue.claim_many("w1", ["default", "low"], 3)
    assert [(x.job_id, x.attempt) for x in first] == [(a, 2), (b, 1), (c, 1)]
    # a cancelled entry on the way is dropped, not counted; the rest of the queue, then the next
    rest = await queue.claim_many("w2", ["default", "low"], 10)
    assert [x.job_id for x in rest] == [d, e, low]
    assert {x.worker for x in rest} == {"w2"}
    assert (await queue.get(dropped)).state is JobState.CANCELLED
    assert await queue.claim_many("w2", ["default", "low"], 10) == []


async def test_claim_many_keeps_what_it_claimed_when_a_later_queue_fails(
    queue: JobQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, _ = await queue.enqueue(spec(queue="first"))
    await queue.enqueue(spec(queue="second"))
    call, calls = queue._call, [0]

    async def second_call_fails(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise RedisConnectionError("connection lost")
        return await call(*args, **kwargs)

    monkeypatch.setattr(queue, "_call", second_call_fails)
    got = await queue.claim_many("w1", ["first", "second"], 2)
    assert [lease.job_id for lease in got] == [first]  # handed out, not stranded as running
    calls[0] = 1
    with pytest.raises(RedisConnectionError):  # nothing claimed: the caller hears of it
        await queue.claim_many("w1", ["second"], 1)


async def test_claim_many_counts_out_the_gpus_of_what_it_claims(queue: JobQueue) -> None:
    two, _ = await queue.enqueue(spec(gpus=2))
    share, _ = await queue.enqueue(spec())  # asks for none: gets the slot's share (1 here)
    too_big, _ = await queue.enqueue(spec(gpus=2))
    after, _ = await queue.enqueue(spec())
    got = await queue.claim_many("w1", ["default"], 4, Capacity(gpus_free=4, slot_gpus=1))
    # 2 + 1 of 4 GPUs are taken: the next job needs 2, so it waits at the head, and so does `after`
    assert [x.job_id for x in got] == [two, share]
    assert (await queue.get(too_big)).state is JobState.QUEUED
    assert [x.job_id for x in await queue.claim_many("w2", ["default"], 4, Capacity(3, 1))] == [
        too_big,
        after,
    ]


async def test_every_job_claimed_once_by_concurrent_batch_claimers(queue: JobQueue, server: Server) -> None:
    total = 2000
    ids = set(await queue.enqueue_many([spec(i) for i in range(total)]))
    claims: list[tuple[str, str]] = []

    async def consumer(name: str, q: JobQueue, batch: int) -> None:
        while leases := await q.claim_many(name, ["default"], batch):
            claims.extend((lease.job_id, name) for lease in leases)
            await asyncio.gather(*(q.complete(lease, OK) for lease in leases))

    clients = [server.client() for _ in range(3)]
    shared = JobQueue(clients[0])  # several claimers on one JobQueue: their calls share pipelines
    queues = [shared, shared, JobQueue(clients[1]), JobQueue(clients[2])]
    await asyncio.gather(*(consumer(f"c{i}", q, 1 + i * 3) for i, q in enumerate(queues)))
    for client in clients:
        await client.aclose()
    claimed_ids = [job_id for job_id, _ in claims]
    assert len(claimed_ids) == total
    assert set(claimed_ids) == ids
    assert len({name for _, name in claims}) > 1
    assert await queue.depth("default") == 0
    assert [(await queue.get(job_id)).attempt for job_id in sorted(ids)[:50]] == [1] * 50


async def test_stale_attempt_cannot_complete_and_results_are_recorded_once(
    queue: JobQueue, redis: AnyRedis
) -> None:
    job_id, _ = await queue.enqueue(spec())
    zombie = await claim(queue, "w-zombie")
    await expire(queue, redis, zombie)
    current = await claim(queue, "w-new")
    assert current.attempt == 2

    with pytest.raises(StaleAttempt):
        await queue.complete(zombie, Outcome(JobState.FAILED, exit_code=1))
    info = await queue.get(job_id)
    assert (info.state, info.worker, info.exit_code) == (JobState.RUNNING, "w-new", None)

    assert await queue.complete(current, OK) is JobState.SUCCEEDED
    # Another complete of the same lease (a reply lost, a bug) answers as the first did and
    # records nothing: one outcome.
    assert await queue.complete(current, Outcome(JobState.FAILED, exit_code=9)) is JobState.SUCCEEDED
    info = await queue.get(job_id)
    assert (info.state, info.exit_code) == (JobState.SUCCEEDED, 0)
    events = cast(list[tuple[bytes, dict[bytes, bytes]]], await redis.xrange(keys.events("default")))
    assert [fields[b"job"].decode() for _, fields in events] == [job_id]


async def test_renew_after_reclaim_answers_lost_and_does_not_take_the_lease_back(
    queue: JobQueue, redis: AnyRedis
) -> None:
    job_id, _ = await queue.enqueue(spec())
    await queue.enqueue(spec())
    lease = await claim(queue, "w1")
    kept = await claim(queue, "w1")
    await expire(queue, redis, lease)

    assert await queue.renew("w1", [lease, kept]) == {lease.id: RenewStatus.LOST, kept.id: RenewStatus.OK}
    assert await redis.zscore(keys.leases("default"), job_id) is None
    assert (await queue.get(job_id)).state is JobState.QUEUED
    # and after someone else claimed it, the old holder still cannot renew it
    again = await claim(queue, "w2")
    assert again.job_id == job_id
    assert await queue.renew("w1", [lease]) == {lease.id: RenewStatus.LOST}
    assert await queue.renew("w2", [again]) == {again.id: RenewStatus.OK}


async def test_renewed_lease_is_never_reclaimed_but_a_silent_one_is(redis: AnyRedis) -> None:
    # Leases of 2 s renewed every ~50 ms: the renewals keep a margin of seconds, so a loaded
    # machine stalling this loop for a while does not let the living lease lapse.
    queue = JobQueue(redis, lease_seconds=2.0)
    await queue.enqueue(spec(1))
    await queue.enqueue(spec(2))
    alive = await claim(queue, "alive")
    silent = await claim(queue, "silent")
    reclaimed: list[tuple[str, JobState]] = []
    deadline = time.monotonic() + 2.6  # past the silent lease's deadline
    while time.monotonic() < deadline:
        assert (await queue.renew("alive", [alive]))[alive.id] is RenewStatus.OK
        reclaimed += await queue.reclaim()
        await asyncio.sleep(0.05)
    assert reclaimed == [(silent.job_id, JobState.QUEUED)]
    assert (await queue.get(alive.job_id)).state is JobState.RUNNING


async def test_idempotent_enqueue_returns_the_same_id(queue: JobQueue, server: Server) -> None:
    first, created = await queue.enqueue(spec(), idempotency_key="run-42")
    again, created_again = await queue.enqueue(spec(), idempotency_key="run-42")
    assert (created, created_again, again) == (True, False, first)

    clients = [server.client() for _ in range(10)]
    results = await asyncio.gather(*(JobQueue(c).enqueue(spec(7), idempotency_key="storm") for c in clients))
    assert len({job_id for job_id, _ in results}) == 1
    assert sum(created for _, created in results) == 1
    for c in clients:
        await c.aclose()
    assert len(await queue.list_jobs()) == 2


async def test_a_key_used_again_for_another_job_is_a_conflict_not_the_first_job(queue: JobQueue) -> None:
    """issue 43 item 8: `--key` reused with a different command no longer answers the first job
    as if it were this one: it is refused, saying which job holds the key; the same job sent
    again is still answered with the first one, and nothing was added."""
    first, _ = await queue.enqueue(spec(1, user="alice"), idempotency_key="run-42")
    with pytest.raises(
        IdempotencyConflict, match=rf"key 'run-42' was used for job {first}, with another spec"
    ):
        await queue.enqueue(spec(2, user="alice"), idempotency_key="run-42")
    assert await queue.enqueue(spec(1, user="alice"), idempotency_key="run-42") == (first, False)
    assert [j.id for j in await queue.list_jobs()] == [first]


async def test_idempotency_keys_are_each_users_in_each_queue(queue: JobQueue) -> None:
    """issue 43 item 7 (idempotency keys): GUARANTEES said a key was per user; it is per user and
    queue (a queue's keys live in its Redis slot, with its jobs, so that one script writes both):
    the same key in another queue, or of another user, is another job. GUARANTEES now says so."""
    mine, _ = await queue.enqueue(spec(1, user="alice"), idempotency_key="k")
    theirs, _ = await queue.enqueue(spec(1, user="bob"), idempotency_key="k")
    elsewhere, _ = await queue.enqueue(spec(1, user="alice", queue="gpu"), idempotency_key="k")
    assert len({mine, theirs, elsewhere}) == 3


async def test_a_failed_job_is_retried_after_a_back_off_that_doubles(redis: AnyRedis) -> None:
    """issue 43 item 8: a failed job with retries went back to the front at once, so a job that
    fails for a moment (a server it needs restarting) spent its retries within the second. Now it
    waits out a back-off, doubled for each failure, before the reaper puts it at the front, while
    the jobs behind it start."""
    queue = JobQueue(redis, lease_seconds=30, retry_backoff=(0.4, 0.6))
    flaky, _ = await queue.enqueue(spec(retries=3))
    later, _ = await queue.enqueue(spec())
    for failures, backoff in ((1, 0.4), (2, 0.6)):  # (doubled to 0.8, held to the most: 0.6)
        lease = await claim(queue)
        assert lease.job_id == flaky
        assert await queue.complete(lease, Outcome(JobState.FAILED, exit_code=1)) is JobState.QUEUED
        ended = (await queue.get(flaky)).attempts[-1].ended_at
        retry_at = await queue.retry_at(flaky)
        assert ended is not None
        assert retry_at is not None
        assert retry_at - ended == pytest.approx(backoff, abs=0.005)
        if failures == 1:
            assert (await claim(queue)).job_id == later  # behind it, started meanwhile
        await queue.reclaim()
        assert await queue.claim("w1", ("default",)) is None  # not before its back-off
        await asyncio.sleep(backoff + 0.05)
        await queue.reclaim()  # the reaper's pass puts it at the front
    assert ((lease := await claim(queue)).job_id, lease.attempt) == (flaky, 3)


async def test_cancel_a_queued_job_it_never_starts(queue: JobQueue) -> None:
    doomed, _ = await queue.enqueue(spec(1))
    nxt, _ = await queue.enqueue(spec(2))
    assert await queue.cancel(doomed) == "cancelled"
    assert (await claim(queue)).job_id == nxt
    assert await queue.claim("w1", ["default"]) is None
    assert (await queue.get(doomed)).state is JobState.CANCELLED
    assert await queue.cancel(doomed) == "cancelled"  # cancelling twice is harmless


async def test_cancel_a_running_job_flags_its_worker(queue: JobQueue, redis: AnyRedis) -> None:
    job_id, _ = await queue.enqueue(spec())
    lease = await claim(queue)
    assert await queue.cancel(job_id) == "cancelling"
    assert await queue.renew("w1", [lease]) == {lease.id: RenewStatus.CANCEL}
    assert await queue.complete(lease, Outcome(JobState.CANCELLED, detail="cancelled")) is JobState.CANCELLED
    assert (await queue.get(job_id)).state is JobState.CANCELLED

    # a running job whose worker is gone is cancelled by the reaper, not requeued
    orphan, _ = await queue.enqueue(spec())
    lease = await claim(queue)
    await queue.cancel(orphan)
    await redis.zadd(keys.leases("default"), {orphan: 0})
    assert await queue.reclaim() == [(orphan, JobState.CANCELLED)]


async def test_cancel_unknown_or_malformed_ids(queue: JobQueue) -> None:
    with pytest.raises(JobNotFound):
        await queue.cancel("default.zzzzzzzzzzzz")
    with pytest.raises(InvalidJob):
        await queue.cancel("not a job id")
    with pytest.raises(JobNotFound):
        await queue.get("default.zzzzzzzzzzzz")


async def test_nothing_accepted_is_lost_across_redis_kill_and_restart(redis_server: EmbeddedRedis) -> None:
    client = redis_server.client()
    queue = JobQueue(client)
    ids = await queue.enqueue_many([spec(i) for i in range(150)])
    ids += [(await queue.enqueue(spec(i)))[0] for i in range(50)]
    leases = [await claim(queue) for _ in range(40)]
    for lease in leases[:15]:
        await queue.complete(lease, OK)
    await client.aclose()

    redis_server.kill()  # SIGKILL: no shutdown, no final fsync
    redis_server.start()  # same data directory, replays the AOF

    client = redis_server.client()
    queue = JobQueue(client)
    states = {job_id: (await queue.get(job_id)).state for job_id in ids}
    assert [states[lease.job_id] for lease in leases[:15]] == [JobState.SUCCEEDED] * 15
    assert [states[lease.job_id] for lease in leases[15:]] == [JobState.RUNNING] * 25
    assert sum(s is JobState.QUEUED for s in states.values()) == 160
    for lease in leases[15:]:  # the running attempts' leases survived and still complete
        await queue.complete(lease, OK)
    rest = []
    while (more := await queue.claim("w2", ["default"])) is not None:
        rest.append(more.job_id)
        await queue.complete(more, OK)
    assert rest == ids[40:]  # FIFO preserved across the restart
    assert {(await queue.get(i)).state for i in ids} == {JobState.SUCCEEDED}
    await client.aclose()


async def test_job_lost_max_attempts_times_is_dead_lettered(queue: JobQueue, redis: AnyRedis) -> None:
    poison, _ = await queue.enqueue(spec(max_attempts=2))
    healthy, _ = await queue.enqueue(spec())
    await expire(queue, redis, await claim(queue, "w1"))
    lease = await claim(queue, "w2")
    assert (lease.job_id, lease.attempt) == (poison, 2)
    await redis.zadd(keys.leases("default"), {poison: 0})
    assert await queue.reclaim() == [(poison, JobState.DEAD)]
    info = await queue.get(poison)
    assert info.state is JobState.DEAD
    assert [a.how for a in info.attempts] == ["lost", "lost"]
    assert (await claim(queue, "w3")).job_id == healthy  # the pool goes on


async def test_failed_job_with_retries_runs_again_first(queue: JobQueue) -> None:
    flaky, _ = await queue.enqueue(spec(retries=1))
    later, _ = await queue.enqueue(spec())
    lease = await claim(queue)
    assert await queue.complete(lease, Outcome(JobState.FAILED, exit_code=1)) is JobState.QUEUED
    second = await claim(queue)
    assert (second.job_id, second.attempt) == (flaky, 2)
    assert await queue.complete(second, Outcome(JobState.FAILED, exit_code=1)) is JobState.FAILED
    assert (await claim(queue)).job_id == later


async def test_gpu_jobs_wait_for_a_worker_with_free_gpus(queue: JobQueue) -> None:
    gpu_job, _ = await queue.enqueue(spec(gpus=2))
    cpu_job, _ = await queue.enqueue(spec())
    # head of line: a worker that has the GPUs, busy now, waits for them before the jobs behind
    assert await queue.claim("busy-gpu", ["default"], Capacity(gpus_free=1, gpus_total=2)) is None
    assert (await claim(queue, "big", gpus=2)).job_id == gpu_job
    assert (await claim(queue, "cpu-worker", gpus=0)).job_id == cpu_job


async def test_queues_are_served_in_priority_order(queue: JobQueue) -> None:
    low, _ = await queue.enqueue(spec(queue="low"))
    high, _ = await queue.enqueue(spec(queue="high"))
    assert (await claim(queue, queues=("high", "low"))).job_id == high
    assert (await claim(queue, queues=("high", "low"))).job_id == low
    assert await queue.queues() == ["high", "low"]
    assert queue_of(high) == "high"


async def test_wait_for_work_wakes_on_enqueue_without_polling(queue: JobQueue, redis: AnyRedis) -> None:
    assert await queue.claim("w1", ["default", "other"]) is None
    waiter = asyncio.create_task(queue.wait_for_work(["default", "other"], block=30))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    job_id, _ = await queue.enqueue(spec(queue="other"))
    read = await asyncio.wait_for(waiter, 10)  # woken by the entry, long before its timeout
    assert [stream for stream, _ in read] == [keys.stream("other")]
    assert queue.news(read)
    assert (await queue.claim_many("w1", ["default", "other"], 2))[0].job_id == job_id
    assert not queue.news(read)  # the claim has seen it since
    assert await queue.wait_for_work(["default"], block=0.05) == []


async def test_a_read_for_work_whose_waits_were_cancelled_loses_neither_its_answer_nor_its_connection(
    queue: JobQueue, redis: AnyRedis
) -> None:
    """A worker's wait for work ends otherwise (a slot freed, a job its standing claim took):
    its read is not read meanwhile, and the next wait has its answer, on the same connection."""
    assert await queue.claim("w1", ["default"]) is None
    one = redis if isinstance(redis, Redis) else None  # (a Cluster's read is redis-py's, as before)
    read = queue.read_for_work(["default"], block=5)
    try:
        for n in range(3):
            waiting = asyncio.ensure_future(read.answer())
            await asyncio.sleep(0.05)
            await cancel_and_wait(waiting)
            if n == 0:  # sent, on a connection of its own; the enqueues' made
                await queue.enqueue(spec(queue="other"))
                connections = int((await one.info("stats"))["total_connections_received"]) if one else 0
        await queue.enqueue(spec())
        await asyncio.sleep(0.1)  # answered by now, in the socket
        assert read.woken is None
        woken = await asyncio.wait_for(read.answer(), 5)
        assert [stream for stream, _ in woken] == [keys.stream("default")]
        assert queue.news(woken)
    finally:
        await read.close()
    if one is not None:
        assert int((await one.info("stats"))["total_connections_received"]) == connections


async def test_list_and_depth(queue: JobQueue) -> None:
    ids = [(await queue.enqueue(spec(i)))[0] for i in range(4)]
    lease = await claim(queue)
    await queue.cancel(ids[3])
    assert await queue.depth("default") == 2
    active = await queue.list_jobs()
    assert [(j.id, j.state) for j in active] == [
        (ids[0], JobState.RUNNING),
        (ids[1], JobState.QUEUED),
        (ids[2], JobState.QUEUED),
    ]
    await queue.complete(lease, OK)
    everything = await queue.list_jobs(include_finished=True)
    assert [j.state for j in everything] == [
        JobState.SUCCEEDED,
        JobState.QUEUED,
        JobState.QUEUED,
        JobState.CANCELLED,
    ]
    assert await queue.depth("nothing-here") == 0


async def test_priority_jobs_start_before_the_stream_highest_first_in_order_among_equals(
    queue: JobQueue, redis: AnyRedis
) -> None:
    priorities = [0, 5, 0, 10, 5]
    ids = [(await queue.enqueue(spec(i, priority=p)))[0] for i, p in enumerate(priorities)]
    ids += await queue.enqueue_many([spec(5, priority=7), spec(6)])
    reclaimed = await claim(queue)  # the priority-10 job; then taken back, to the front
    assert reclaimed.job_id == ids[3]
    await expire(queue, redis, reclaimed)
    assert await queue.depth("default") == len(ids)  # each job counted once
    listed = [j.id for j in await queue.list_jobs()]
    order = []
    while (lease := await queue.claim("w1", ["default"])) is not None:
        order.append(lease.job_id)
    expected = [ids[3], ids[5], ids[1], ids[4], ids[0], ids[2], ids[6]]  # front, 7, 5, 5, then FIFO
    assert order == expected
    assert listed == expected  # `ls` shows the order they start in
    assert await queue.depth("default") == 0


async def test_a_cancelled_priority_job_never_starts(queue: JobQueue) -> None:
    first, _ = await queue.enqueue(spec(0))
    urgent, _ = await queue.enqueue(spec(1, priority=50))
    assert await queue.cancel(urgent) == "cancelled"
    assert await queue.depth("default") == 1
    assert (await claim(queue)).job_id == first
    assert await queue.claim("w1", ["default"]) is None


async def test_a_priority_job_waits_for_gpus_at_the_head_and_one_too_big_is_passed_over(
    queue: JobQueue,
) -> None:
    small, _ = await queue.enqueue(spec(0, gpus=1))
    big, _ = await queue.enqueue(spec(1, gpus=2, priority=9))
    # A worker of 2 GPUs with 1 free: the priority job heads the line and waits for its GPUs.
    assert await queue.claim("w1", ["default"], Capacity(gpus_free=1, gpus_total=2)) is None
    # A worker of 1 GPU can never hold it: passed over, the job behind it starts.
    lease = await queue.claim("w2", ["default"], Capacity(gpus_free=1, gpus_total=1))
    assert lease is not None
    assert lease.job_id == small
    lease = await queue.claim("w1", ["default"], Capacity(gpus_free=2, gpus_total=2))
    assert lease is not None
    assert lease.job_id == big  # parked, and found there by a worker big enough


async def test_a_user_at_the_cap_waits_while_others_start_and_goes_first_once_below_it(
    redis: AnyRedis,
) -> None:
    queue = JobQueue(redis, lease_seconds=30, user_caps=(2, 0))
    alice = [(await queue.enqueue(spec(i, user="alice")))[0] for i in range(4)]
    bob = [(await queue.enqueue(spec(i, user="bob")))[0] for i in range(2)]
    first = await queue.claim_many("w1", ["default"], 8)
    assert [lease.job_id for lease in first] == [*alice[:2], *bob]  # alice's third waits for her
    assert await queue.depth("default") == 2  # her two held jobs are still queued
    assert [j.id for j in await queue.list_jobs() if j.state is JobState.QUEUED] == alice[2:]
    assert await queue.claim("w1", ["default"]) is None
    late, _ = await queue.enqueue(spec(9, user="carol"))
    await queue.complete(first[0], OK)  # alice below her cap: her oldest held job goes first
    assert [lease.job_id for lease in await queue.claim_many("w1", ["default"], 8)] == [alice[2], late]
    assert await queue.cancel(alice[3]) == "cancelled"  # a held job cancelled never starts
    await queue.complete(first[1], OK)
    assert await queue.claim("w1", ["default"]) is None
    assert await queue.depth("default") == 0


async def test_a_gpu_cap_holds_a_users_jobs_but_never_all_of_them(redis: AnyRedis) -> None:
    queue = JobQueue(redis, lease_seconds=30, user_caps=(0, 2))
    big, _ = await queue.enqueue(spec(0, user="alice", gpus=4))  # over the cap alone: runs alone
    small = [(await queue.enqueue(spec(i, user="alice", gpus=1)))[0] for i in range(2)]
    other, _ = await queue.enqueue(spec(9, user="bob", gpus=2))
    got = await queue.claim_many("w1", ["default"], 4, Capacity(gpus_free=8, gpus_total=8))
    assert [lease.job_id for lease in got] == [big, other]  # alice at 4 GPUs: hers wait
    await queue.complete(got[0], OK)
    got = await queue.claim_many("w1", ["default"], 4, Capacity(gpus_free=6, gpus_total=8))
    assert [lease.job_id for lease in got] == small  # 1 + 1 GPUs: within her cap of 2


async def test_a_held_job_too_big_for_a_worker_does_not_hide_its_users_others(redis: AnyRedis) -> None:
    queue = JobQueue(redis, lease_seconds=30, user_caps=(1, 0))
    first, big, small = [
        (await queue.enqueue(spec(i, user="alice", gpus=g)))[0] for i, g in enumerate((1, 8, 1))
    ]
    running = await queue.claim_many("big-worker", ["default"], 3, Capacity(gpus_free=8, gpus_total=8))
    assert [lease.job_id for lease in running] == [first]  # the other two held: alice is at her cap
    await queue.complete(running[0], OK)
    lease = await queue.claim("small-worker", ["default"], Capacity(gpus_free=1, gpus_total=1))
    assert lease is not None
    assert lease.job_id == small  # her 8-GPU job, older, waits for a worker big enough
    assert (await queue.get(big)).state is JobState.QUEUED


async def test_a_long_run_of_jobs_set_aside_never_lets_a_later_job_start_before_the_front(
    redis: AnyRedis,
) -> None:
    """A claim sets aside at most 100 jobs (parked, held) and then stops: it never goes on to
    start jobs behind those it has not looked at yet."""
    plain = JobQueue(redis, lease_seconds=30)
    alices = await plain.enqueue_many([spec(i, user="alice") for i in range(102)])
    bobs, _ = await plain.enqueue(spec(0, user="bob"))
    for lease in await plain.claim_many("w0", ["default"], 103):  # all of them taken back: the front
        await redis.zadd(keys.leases("default"), {lease.job_id: 0})
    assert len(await plain.reclaim()) == 103
    carols, _ = await plain.enqueue(spec(0, user="carol"))  # a job that never started, behind them
    capped = JobQueue(redis, lease_seconds=30, user_caps=(1, 0))
    started: list[str] = []
    for _ in range(5):
        started += [lease.job_id for lease in await capped.claim_many("w1", ["default"], 3)]
    assert started == [alices[0], bobs, carols]  # bob's retried job before carol's new one
    urgent = await plain.enqueue_many([spec(i, user="alice", priority=5) for i in range(150)])
    assert not await capped.claim_many("w1", ["default"], 3)  # alice at her cap: all held, 100 a call
    assert await redis.zcard(keys.capped("default")) <= 101 + 100
    assert (await plain.get(urgent[-1])).state is JobState.QUEUED


async def test_a_requeued_job_is_handed_back_to_the_front_and_runs_again_once(queue: JobQueue) -> None:
    job_id, _ = await queue.enqueue(spec(0))
    behind, _ = await queue.enqueue(spec(1))
    lease = await claim(queue)
    assert await queue.requeue(behind) == "queued"  # not started: nothing to do
    assert await queue.requeue(job_id) == "requeueing"
    assert await queue.renew("w1", [lease]) == {lease.id: RenewStatus.REQUEUE}
    assert await queue.hand_back(lease) is JobState.QUEUED  # the worker stopped it and handed it back
    again = await claim(queue, "w2")
    assert (again.job_id, again.attempt) == (job_id, 2)  # at the front, before the job behind it
    assert await queue.renew("w2", [again]) == {again.id: RenewStatus.OK}  # asked for once, done once
    await queue.complete(again, OK)
    assert await queue.requeue(job_id) == "succeeded"
    info = await queue.get(job_id)
    assert [a.how for a in info.attempts] == ["released", "succeeded"]
    with pytest.raises(JobNotFound):
        await queue.requeue("default.doesnotexist1")


async def test_hand_backs_by_the_pools_gpu_policies_are_losses_and_end_at_max_attempts(
    queue: JobQueue,
) -> None:
    """issue 50, a review's finding: the idle-GPU policy's requeue and GPU health's hand-back were
    hand-backs like a drain's, never a loss towards max_attempts: a job that idles wherever it
    runs (or faults every GPU it runs on) went round for ever, holding GPUs. A hand-back by a
    policy counts as a loss; at max_attempts the job is dead, saying why. A drain's does not."""
    job_id, _ = await queue.enqueue(spec(0, max_attempts=2))
    lease = await claim(queue)
    assert await queue.hand_back(lease) is JobState.QUEUED  # a drain: no loss
    lease = await claim(queue)
    assert await queue.hand_back(lease, by_policy=True) is JobState.QUEUED  # loss 1 of 2
    lease = await claim(queue)
    assert lease.attempt == 3
    assert await queue.hand_back(lease, by_policy=True) is JobState.DEAD
    info = await queue.get(job_id)
    assert [a.how for a in info.attempts] == ["released", "released", "released"]
    assert "handed back by the pool's GPU policies" in info.detail


async def test_a_job_claimed_ahead_that_never_started_is_no_loss_and_costs_its_user_nothing(
    redis: AnyRedis,
) -> None:
    """issue 43 item 7 (look-ahead): jobs a worker claimed ahead of a free slot (worker/fast_path.py)
    that never started, because the worker froze or died first, were taken back as losses: a
    `--max-attempts 1` job was dead-lettered unrun, and fair share billed its user for the time it
    was held. A claim now says which of its jobs go to free slots; the others are marked until
    their worker says they started, and a reclaim of one still marked is a hand-back."""
    queue = JobQueue(redis, lease_seconds=30, fairshare=["default"])
    ids = [(await queue.enqueue(spec(i, user="alice", max_attempts=1)))[0] for i in range(3)]
    leases = await queue.claim_many("w1", ["default"], 3, slots=1)
    assert [(lease.job_id, lease.ahead) for lease in leases] == [
        (ids[0], False),
        (ids[1], True),
        (ids[2], True),
    ]
    await queue.mark_started(leases[2])  # a slot freed, and it started there
    await asyncio.sleep(0.05)
    await redis.zadd(keys.leases("default"), dict.fromkeys(ids, 0))  # the worker froze
    assert sorted(await queue.reclaim()) == sorted(
        [(ids[0], JobState.DEAD), (ids[1], JobState.QUEUED), (ids[2], JobState.DEAD)]
    )
    kept = await queue.get(ids[1])
    assert [a.how for a in kept.attempts] == ["released"]  # handed back, never a loss
    assert (kept.state, await redis.hget(keys.job(ids[1]), "losses")) == (JobState.QUEUED, b"0")
    await queue.cancel(ids[1])
    used = await redis.hget(keys.fairshare("default"), "u:alice")
    later, _ = await queue.enqueue(spec(9, user="alice"))
    again = await queue.claim_many("w2", ["default"], 1, slots=0)  # claimed ahead, held a while
    assert [lease.job_id for lease in again] == [later]
    await asyncio.sleep(0.05)
    await redis.zadd(keys.leases("default"), {later: 0})
    await queue.reclaim()
    assert await redis.hget(keys.fairshare("default"), "u:alice") == used  # its hold billed nothing


async def test_a_claim_ahead_of_a_free_slot_never_takes_the_front(queue: JobQueue, redis: AnyRedis) -> None:
    """issue 43 item 7 (look-ahead): a job at the front (taken back, handed back, retried) is
    never claimed ahead of a free slot: what starts there is the worker's word alone, so a job
    that kills its worker the moment it starts is counted (as a loss) the next time it runs. The
    claim stops there rather than take the jobs behind it out of order."""
    first, _ = await queue.enqueue(spec(1))
    second, _ = await queue.enqueue(spec(2))
    await expire(queue, redis, await claim(queue))  # the first is back at the front
    assert await queue.claim_many("w1", ["default"], 2, slots=0) == []
    assert await queue.wait_for_work(["default"], 0.3) == []  # it waits for news: no spin
    got = await queue.claim_many("w1", ["default"], 2, slots=1)
    assert [(lease.job_id, lease.ahead) for lease in got] == [(first, False), (second, True)]


async def test_a_standing_claim_marks_what_it_claims_ahead_of_a_free_slot(
    queue: JobQueue, redis: AnyRedis
) -> None:
    """issue 43 item 7 (look-ahead): an idle worker's standing claim (work_watch.py) made while
    it looks ahead asks for more jobs than it has free slots: those beyond are claimed ahead too,
    and marked so, as a claim of its own marks them."""
    ids = [(await queue.enqueue(spec(i)))[0] for i in range(2)]
    standing = queue.stand("w1", ["default"], 3, slots=1)
    assert standing is not None
    ids.append((await queue.enqueue(spec(2)))[0])  # sends the standing claim in its round trip
    got = await queue.standing_claimed(standing)
    assert [(lease.job_id, lease.ahead) for lease in got] == [(ids[0], False), (ids[1], True), (ids[2], True)]
    assert [await redis.hget(keys.job(i), "ahead") for i in ids] == [None, b"1", b"1"]


async def test_a_users_unended_jobs_are_counted_exactly_however_they_move_and_end(redis: AnyRedis) -> None:
    """issue 44 item 6: what a user has queued or running in a queue is counted by the scripts
    that add and end jobs, exactly, through a reclaim, a requeue, a retry, an array's window, a
    wait for another job, a cancel and a dead-letter; the enqueue that would pass the bound is
    refused, writing nothing, and another user's count is their own."""
    queue = JobQueue(redis, lease_seconds=30, max_unended=5)

    async def count(user: str = "alice") -> int:
        return (await queue.unended(user, ["default"]))["default"]

    first, _ = await queue.enqueue(spec(0, user="alice", retries=1))
    array = [spec(i, user="alice", array="default@abcd", array_pos=i, array_limit=1) for i in range(2)]
    await queue.enqueue_many(array)  # the second waits for the first's place in the window
    waits, _ = await queue.enqueue(spec(3, user="alice", after=(f"{first}:ok",)))
    dies, _ = await queue.enqueue(spec(4, user="alice", max_attempts=1))
    await queue.enqueue(spec(5, user="bob"))
    assert (await count(), await count("bob")) == (5, 1)
    with pytest.raises(TooManyUnended, match="user_max_queued_jobs"):
        await queue.enqueue(spec(6, user="alice"))
    with pytest.raises(TooManyUnended):
        await queue.enqueue_many([spec(7, user="alice")])
    assert await count() == 5  # refused whole: nothing written

    lease = await claim(queue)  # `first`, reclaimed, requeued, retried: queued or running throughout
    assert lease.job_id == first
    await expire(queue, redis, lease)
    lease = await claim(queue, "w2")
    await queue.requeue(first)
    assert await queue.hand_back(lease) is JobState.QUEUED
    lease = await claim(queue, "w3")
    assert await queue.complete(lease, Outcome(JobState.FAILED, exit_code=1)) is JobState.QUEUED
    assert await count() == 5
    lease = await claim(queue, "w4")
    assert await queue.complete(lease, Outcome(JobState.FAILED, exit_code=1)) is JobState.FAILED
    assert await count() == 4
    assert await queue.cancel(waits, "its dependency failed") == "cancelled"  # as the server's judge
    assert await count() == 3
    lease = await claim(queue)  # the array's first: its end lets the second in
    assert lease.job_id.startswith("default.")
    assert (await queue.get(lease.job_id)).spec.array
    await queue.complete(lease, OK)
    assert await count() == 2
    assert (await claim(queue)).job_id == dies  # lost on its one attempt: dead-lettered below
    await claim(queue, "w5")  # bob's
    second = await claim(queue, "w6")  # the array's second, let in at the tail
    assert second.job_id not in (dies, first)
    await queue.cancel(second.job_id)  # running: its worker is dead, so the reaper ends it
    await redis.zadd(keys.leases("default"), {dies: 0, second.job_id: 0})
    assert sorted(s for _, s in await queue.reclaim()) == [JobState.CANCELLED, JobState.DEAD]
    assert await count() == 0
    assert await redis.hkeys(keys.unended("default")) == [b"bob"]  # a user at 0 leaves the hash
    await queue.enqueue(spec(8, user="alice"))  # room again


async def test_a_user_who_enqueues_and_cancels_cannot_fill_redis_for_everyone(redis: AnyRedis) -> None:
    """issue 44 item 6: a cancelled or ended job's record stays for the retention, so counting
    only jobs not ended let one user fill Redis by enqueueing and cancelling (300 rounds of 60 KB
    grew it 18 MiB with the count at 0). What a user submits is counted in bytes, over every
    queue, and refused past user_max_stored_bytes, saying when room comes back; a refused
    submission counts nothing, and another user is still served."""
    queue = JobQueue(redis, max_unended=5, max_stored=2**20)
    big = ("echo", "x" * 60_000)
    refused: TooMuchStored | None = None
    for rounds in range(100):  # (rounds: how many were taken)
        try:
            job_id, _ = await queue.enqueue(
                JobSpec(argv=big, user="alice", queue=("default", "other")[rounds % 2])
            )
        except TooMuchStored as exc:
            refused = exc
            break
        assert await queue.cancel(job_id) == "cancelled"
    assert rounds == 15  # 15 of 66 KB (60 KB and a record's 6 KiB) within 1 MiB
    assert refused is not None
    assert "user_max_stored_bytes" in str(refused)
    assert "room comes back" in str(refused)
    assert "Nothing of this submission was queued" in str(refused)
    with pytest.raises(TooMuchStored):  # in any queue, one at a time or in a batch
        await queue.enqueue_many([JobSpec(argv=big, user="alice", queue="third")])
    await queue.enqueue(JobSpec(argv=("echo", "small"), user="alice"))  # what is left still fits
    assert [await redis.zcard(keys.jobs(q)) for q in ("default", "other", "third")] == [9, 7, 0]
    for _ in range(5):
        await queue.enqueue(JobSpec(argv=big, user="bob"))
    with pytest.raises(TooManyUnended):  # refused by its count in the queue: its bytes given back
        await queue.enqueue(JobSpec(argv=big, user="bob"))
    await queue.enqueue(JobSpec(argv=big, user="bob", queue="other"))


async def test_a_submission_redis_refuses_at_maxmemory_gives_its_counted_bytes_back(
    redis_server: EmbeddedRedis,
) -> None:
    """issue 44 item 7 (review of item 6): the bytes a submission counted (store.lua) stayed
    counted when Redis then refused its enqueue, though nothing was written: at maxmemory each
    refused submission took room from its user for the retention. A refusal (ResponseError) gives
    them back, in one call and in a batch. Redis is full from before the count: the count gets
    through only as a script that has written first does (it prunes a day past the retention)."""
    async with redis_server.client() as client:
        queue = JobQueue(client, max_stored=2**20)
        await queue.enqueue(JobSpec(argv=("echo", "x"), user="alice"))
        held = await client.hgetall(keys.stored("alice"))
        for submit in (
            lambda: queue.enqueue(JobSpec(argv=("echo", "y" * 1000), user="alice")),
            lambda: queue.enqueue_many([JobSpec(argv=("echo", "z" * 1000), user="alice")] * 3),
        ):
            await client.hset(keys.stored("alice"), "1", 5)  # day 1 (1970): long past the retention
            async with memory_full(redis_server):
                with pytest.raises(ResponseError, match="maxmemory"):
                    await submit()
            assert await client.hgetall(keys.stored("alice")) == held


async def test_a_batch_over_the_bound_writes_none_of_its_jobs(redis: AnyRedis) -> None:
    """issue 44 item 6: a batch went to Redis as calls of 100 jobs, each judged alone, so a
    batch over a user's bound of jobs not ended still wrote some of them (the first call passed,
    the second was refused, the third passed). The first call judges the whole batch, and one
    refused makes the others refuse: nothing of it is written."""
    queue = JobQueue(redis, max_unended=150)
    with pytest.raises(TooManyUnended, match="250 more would pass the 150"):
        await queue.enqueue_many([spec(i, user="alice") for i in range(250)])
    assert await redis.zcard(keys.jobs("default")) == 0
    assert (await queue.unended("alice", ["default"]))["default"] == 0
    await queue.enqueue_many([spec(i, user="alice") for i in range(100)])
    with pytest.raises(TooManyUnended):  # a batch over two queues: judged per queue
        await queue.enqueue_many(
            [spec(i, user="alice", queue=("default", "other")[i % 2]) for i in range(250)]
        )
    assert (await redis.zcard(keys.jobs("default")), await redis.zcard(keys.jobs("other"))) == (100, 0)
    ids = await queue.enqueue_many([spec(i, user="alice") for i in range(50)] + [spec(0, user="bob")] * 120)
    assert len(ids) == 170
