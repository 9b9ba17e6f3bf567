"""The queue's scripts under the faults a review found (issue 12), on a real redis-server: GPU
requests no worker can meet, Redis at its memory limit, lost replies, lost writes, and growth
over months. Each test's docstring names the item it covers."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from daemon.errors import StaleAttempt
from daemon.job import JobSpec, JobState, Lease, Outcome, RenewStatus
from daemon.queue import keys, registry
from daemon.queue.claims import REPLY_HEAD, Capacity
from daemon.queue.connection import connect
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.failures import out_of_memory
from daemon.queue.job_queue import JobQueue
from daemon.queue.registry import Registration, add_heartbeat
from daemon.queue.scripts import ScriptBatch
from tests.support.faults import aof_copy, memory_full, roll_back
from tests.support.proxy import Proxy

OK = Outcome(JobState.SUCCEEDED, exit_code=0)
FAILED = Outcome(JobState.FAILED, exit_code=1)


def spec(n: int = 0, **kw: object) -> JobSpec:
    return JobSpec(argv=("echo", str(n)), **kw)  # type: ignore[arg-type]


async def claim(queue: JobQueue, worker: str = "w1", gpus: int = 0) -> Lease:
    lease = await queue.claim(worker, ["default"], Capacity(gpus))
    assert lease is not None
    return lease


async def expire(queue: JobQueue, lease: Lease) -> None:
    await queue.redis.zadd(keys.leases(lease.queue), {lease.job_id: 0})
    await queue.reclaim()


async def test_a_job_too_big_for_a_worker_is_passed_over_not_waited_for(queue: JobQueue) -> None:
    """Item 1: a job needing more GPUs than a worker has at all stalled its queue for good; the
    worker now passes it over (it stays queued, at the front) and runs the jobs behind it, in
    their order, while a worker that has the GPUs but not free now still waits for them."""
    big, _ = await queue.enqueue(spec(0, gpus=4))
    small = [(await queue.enqueue(spec(i)))[0] for i in range(1, 4)]
    assert (await claim(queue, "cpu-worker")).job_id == small[0]
    assert (await claim(queue, "cpu-worker")).job_id == small[1]
    assert (await queue.get(big)).state is JobState.QUEUED
    # head of line holds among workers that can hold the job: a 4-GPU worker with 2 free waits
    assert await queue.claim("busy-big", ["default"], Capacity(2, gpus_total=4)) is None
    assert (await claim(queue, "big-worker", gpus=4)).job_id == big
    assert (await claim(queue, "cpu-worker")).job_id == small[2]
    assert await queue.depth("default") == 0


async def test_many_passed_over_jobs_do_not_hold_up_a_retried_one(queue: JobQueue) -> None:
    """Item 1 (a review's follow-up): passed-over jobs sat at the front among retried ones, and a
    claim looked at no more than 100 of them, so a retried job behind 100 big ones never ran."""
    await queue.enqueue_many([spec(i, gpus=16, wait_for_worker=True) for i in range(150)])
    retried, _ = await queue.enqueue(spec(retries=1))
    got = [await queue.claim("cpu-worker", ["default"]) for _ in range(2)]  # a bounded pass each
    first = next(lease for lease in got if lease is not None)  # the 150 passed over on the way
    assert first.job_id == retried
    assert await queue.complete(first, FAILED) is JobState.QUEUED  # back at the front
    again = await claim(queue, "cpu-worker")
    assert (again.job_id, again.attempt) == (retried, 2)
    assert await queue.depth("default") == 150
    assert (await claim(queue, "big", gpus=16)).spec.argv == ("echo", "0")  # the oldest of them
    # among parked jobs of different sizes, the oldest a worker can hold goes first
    eight, _ = await queue.enqueue(spec(gpus=8))
    four, _ = await queue.enqueue(spec(gpus=4))
    await queue.claim("cpu-worker", ["default"])  # parks both
    assert (await claim(queue, "eight-gpus", gpus=8)).job_id == eight
    assert (await claim(queue, "eight-gpus", gpus=8)).job_id == four


async def test_at_maxmemory_nothing_is_granted_and_endings_still_go_through(
    redis_server: EmbeddedRedis, queue: JobQueue
) -> None:
    """Item 2: with Redis at maxmemory, renewals and heartbeats were refused but claims were not,
    so a worker that could not renew kept taking jobs. Now what grants or adds (claim, enqueue,
    log, heartbeat) is refused whole, and what ends, takes back or only extends (complete,
    reclaim, renew, cancel) still works: running jobs keep their leases, and ending jobs is how
    memory comes back."""
    running, _ = await queue.enqueue(spec(1))
    lost_job, _ = await queue.enqueue(spec(2))
    cancelled, _ = await queue.enqueue(spec(3))
    lease = await claim(queue)
    lost = await claim(queue, "w2")
    doomed = await claim(queue, "w3")
    await queue.redis.zadd(keys.leases("default"), {lost.job_id: 0})  # its worker went silent
    async with memory_full(redis_server):
        for refused in (
            lambda: queue.claim("w4", ["default"]),
            lambda: queue.enqueue(spec(4)),
            lambda: queue.append_log(lease, 1, [b"output\n"]),
            lambda: _heartbeat(queue, "w1"),
        ):
            with pytest.raises(RedisError) as exc:
                await refused()
            assert out_of_memory(exc.value), exc.value
        assert await queue.renew("w1", [lease]) == {lease.id: RenewStatus.OK}
        assert await queue.cancel(doomed.job_id) == "cancelling"
        assert await queue.reclaim() == [(lost_job, JobState.QUEUED)]
        assert await queue.complete(lease, OK) is JobState.SUCCEEDED
    # nothing a refused call would have written is there
    assert (await queue.get(lost_job)).attempt == 1
    assert (await queue.get(running)).state is JobState.SUCCEEDED
    assert (await queue.get(cancelled)).cancel_requested
    assert await queue.read_log(running) == []


async def _heartbeat(queue: JobQueue, worker: str) -> None:
    batch = ScriptBatch(queue.redis)
    add_heartbeat(
        batch, queue.scripts, Registration(id=worker, slots=1, queues=["default"], healthy_period=30)
    )
    await batch.execute()


async def test_a_claim_whose_reply_was_lost_is_answered_again_not_made_again(
    redis_server: EmbeddedRedis, queue: JobQueue
) -> None:
    """Item 8: a claim that ran but whose reply was lost (here the connection is cut while the
    reply is held back) left its job running under a worker that did not know it had it. redis-py
    sends the call again on a fresh connection; the second run answers the first's job."""
    first, _ = await queue.enqueue(spec(1))
    second, _ = await queue.enqueue(spec(2))
    proxy = Proxy(redis_server.port)
    await proxy.start()
    client = connect("127.0.0.1", proxy.port, password=redis_server.password)
    try:
        cut = JobQueue(client, lease_seconds=30)
        await client.script_load(cut.scripts.claim.script)  # else the held reply is a NOSCRIPT
        proxy.hold()
        claiming = asyncio.create_task(cut.claim("w1", ["default"]))
        await _until(lambda: any(proxy.held()))  # it ran: its reply is in the proxy
        await proxy.cut()
        lease = await claiming
    finally:
        await client.aclose()
        await proxy.stop()
    assert lease is not None
    assert lease.job_id == first
    assert (await queue.get(second)).state is JobState.QUEUED  # not claimed by the second run
    assert (await queue.get(first)).attempt == 1


async def test_a_claim_cancelled_in_flight_is_settled_and_a_late_copy_claims_nothing(
    redis_server: EmbeddedRedis, queue: JobQueue
) -> None:
    """Item 8: a dispatcher cancelled in the middle of a claim (a draining worker) lost the jobs it
    had claimed until their leases expired. `settle_claims` asks again for what the request got;
    and a copy of an older request arriving late (a slow network) claims nothing."""
    first, _ = await queue.enqueue(spec(1))
    second, _ = await queue.enqueue(spec(2))
    third, _ = await queue.enqueue(spec(3))
    proxy = Proxy(redis_server.port)
    await proxy.start()
    client = connect("127.0.0.1", proxy.port, password=redis_server.password)
    try:
        slow = JobQueue(client, lease_seconds=30)
        await client.script_load(slow.scripts.claim.script)
        proxy.hold()
        claiming = asyncio.create_task(slow.claim("w1", ["default"]))
        await _until(lambda: any(proxy.held()))
        claiming.cancel()
        with pytest.raises(asyncio.CancelledError):
            await claiming
        proxy.release()
        settled = await slow.settle_claims("w1")
        assert [lease.job_id for lease in settled] == [first]
        assert await slow.settle_claims("w1") == []  # nothing left unanswered
        assert (await claim(slow, "w1")).job_id == second  # request 2
    finally:
        await client.aclose()
        await proxy.stop()
    late = queue._request("w1", "default", 1, 1, Capacity())  # request 1 again, after request 2
    reply = await queue.scripts.claim(keys=late.keys(), args=[late.packed()])
    assert reply[REPLY_HEAD:] == []  # no job: what the worker has, and no lease
    assert (await queue.get(third)).state is JobState.QUEUED


async def _until(check: object, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():  # type: ignore[operator]
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_after_redis_lost_its_last_writes_an_old_lease_cannot_write_for_the_new_attempt(
    redis_server: EmbeddedRedis, redis: Redis
) -> None:
    """Item 4: Redis restarted from an older AOF forgot a claim; the job was claimed again with the
    same attempt number, and the forgotten attempt's writes (here its complete) were taken for the
    new one's. Lease ids never repeat, so the forgotten lease is refused."""
    queue = JobQueue(redis, lease_seconds=30)
    job_id, _ = await queue.enqueue(spec())
    before = aof_copy(redis_server)
    forgotten = await claim(queue, "w1")
    roll_back(redis_server, before)
    again = await claim(queue, "w1")
    assert (again.job_id, again.attempt) == (forgotten.job_id, forgotten.attempt) == (job_id, 1)
    assert again.id != forgotten.id
    assert await queue.renew("w1", [forgotten, again]) == {
        forgotten.id: RenewStatus.LOST,
        again.id: RenewStatus.OK,
    }
    with pytest.raises(StaleAttempt):
        await queue.complete(forgotten, FAILED)
    assert (await queue.get(job_id)).state is JobState.RUNNING
    assert await queue.complete(again, OK) is JobState.SUCCEEDED


async def test_a_redis_restarted_on_its_aof_is_new_to_the_pool_until_a_while_after(
    redis_server: EmbeddedRedis,
) -> None:
    """A worker that starts just after Redis restarted pauses its claims (claim_gate.py) because
    the pool has known this redis-server for no time at all: its data may lack claims of attempts
    that still run. A Redis that never held the pool's data is as old as time (nothing it holds
    runs anywhere); at maxmemory the answer is the safe 0."""
    client = redis_server.client()
    queue = JobQueue(client)
    try:
        assert await queue.primary_age(["default"]) > 3600
        await queue.enqueue(spec())
        redis_server.kill()
        redis_server.start()  # on its AOF: the jobs are there, the record names the old process
        assert await queue.primary_age(["default"]) == 0
        await asyncio.sleep(0.3)
        assert 0.2 <= await queue.primary_age(["default"]) < 1.2
        async with memory_full(redis_server):
            await client.delete(keys.primary("default"))  # the next answer would write, which Redis refuses
            assert await queue.primary_age(["default"]) == 0
    finally:
        await client.aclose()


async def test_retried_failures_do_not_count_as_losses(queue: JobQueue) -> None:
    """Item 5: with max_attempts=3 and retries=2, two failures and one loss dead-lettered the job
    (attempts minus hand-backs counted the retries as losses), so its last retry never ran."""
    job_id, _ = await queue.enqueue(spec(max_attempts=3, retries=2))
    for _ in range(2):
        assert await queue.complete(await claim(queue), FAILED) is JobState.QUEUED
    await expire(queue, await claim(queue))
    info = await queue.get(job_id)
    assert info.state is JobState.QUEUED, info.detail
    last = await claim(queue)
    assert last.attempt == 4
    assert await queue.complete(last, OK) is JobState.SUCCEEDED


async def test_a_lost_write_to_the_queue_set_is_made_good(queue: JobQueue, redis: Redis) -> None:
    """Item 6: the pool-wide queue set was written once per server process per queue; if that
    write was lost, the queue vanished for good from the reaper, `wait` and metrics, and a dead
    worker's jobs in it were never reclaimed. Every enqueue, and every heartbeat of a worker
    serving the queue, names it again."""
    await queue.enqueue(spec(queue="q1"))
    lease = await queue.claim("w1", ["q1"])
    assert lease is not None
    await redis.delete(keys.QUEUES)  # the write lost (a Redis restored from an older state)
    await queue.enqueue(spec(queue="q1"))
    assert await queue.queues() == ["q1"]
    await redis.delete(keys.QUEUES)
    await _heartbeat_serving(queue, "w1", ["q1"])
    await redis.zadd(keys.leases("q1"), {lease.job_id: 0})
    assert await queue.reclaim() == [(lease.job_id, JobState.QUEUED)]


async def _heartbeat_serving(queue: JobQueue, worker: str, queues: list[str]) -> None:
    batch = ScriptBatch(queue.redis)
    add_heartbeat(batch, queue.scripts, Registration(id=worker, slots=1, queues=queues, healthy_period=30))
    await batch.execute()


async def test_finished_jobs_leave_the_index_after_retention(redis: Redis) -> None:
    """Item 11: the `jobs` index was trimmed only by `list_jobs`, and only among the newest."""
    queue = JobQueue(redis, lease_seconds=30, retention_seconds=1)
    old = [(await queue.enqueue(spec(i)))[0] for i in range(20)]
    for _ in old:
        await queue.complete(await claim(queue), OK)
    await asyncio.sleep(1.2)
    for i in range(3):  # later jobs finishing forget the old ones, a few at a time
        await queue.enqueue(spec(100 + i))
        await queue.complete(await claim(queue), OK)
    index = {i.decode() for i in cast(list[bytes], await redis.zrange(keys.jobs("default"), 0, -1))}
    assert len(index) == 3
    assert not index & set(old)


async def test_crashed_workers_are_forgotten_after_a_while(queue: JobQueue, redis: Redis) -> None:
    """Item 11: crashed workers stayed in the registry forever, read on every scrape."""
    await _heartbeat(queue, "crashed")
    await _heartbeat(queue, "alive")
    await redis.zadd(keys.WORKERS_SEEN, {"crashed": 1000})  # silent since 1970
    assert await registry.prune(redis, queue.scripts, retention=3600) == ["crashed"]
    assert [w["id"] for w in await registry.list_workers(redis)] == ["alive"]


async def test_a_log_keeps_its_head_and_tail_within_its_bound(redis: Redis) -> None:
    """Item 11: a job's log was capped at 5 000 chunks of up to 64 KiB (about 320 MiB per job in
    Redis). Now it keeps its first quarter of `job_log_max_bytes` and its newest bytes, and says
    where the gap is."""
    queue = JobQueue(redis, lease_seconds=30, log_max_bytes=256 * 1024)
    job_id, _ = await queue.enqueue(spec())
    lease = await claim(queue)
    chunk = 16 * 1024
    for n in range(1, 101):  # 1.6 MiB of output, numbered lines
        await queue.append_log(lease, n, [f"{n:06d}\n".encode() * (chunk // 7)])
    await queue.append_log(lease, 100, [b"sent twice\n"])  # a repeated call writes nothing
    text = b"".join(data for _, data in await queue.read_log(job_id, count=10_000)).decode()
    assert len(text) < 256 * 1024 + 1024
    lines = text.splitlines()
    assert lines[0] == "000001"
    assert lines[-1] == "000100"
    gap = next(line for line in lines if line.startswith("[gpupool]"))
    assert "bytes of output dropped here" in gap
    assert "sent twice" not in text


async def test_depth_counts_jobs_not_wake_ups(queue: JobQueue) -> None:
    """Item 13: `depth()` counted the wake markers reclaims put on the stream as waiting jobs."""
    await queue.enqueue(spec())
    await expire(queue, await claim(queue))
    assert await queue.depth("default") == 1


async def test_listing_shows_queued_jobs_behind_many_running_ones(queue: JobQueue) -> None:
    """Item 13: the listing read the stream from its start, `limit` entries: with that many
    jobs running, the queued ones behind them were missing from `ls` and pending reasons."""
    await queue.enqueue_many([spec(i) for i in range(12)])
    for _ in range(10):
        await claim(queue)
    listed = await queue.list_jobs(limit=10)
    assert sorted(j.state for j in listed).count(JobState.QUEUED) == 2
