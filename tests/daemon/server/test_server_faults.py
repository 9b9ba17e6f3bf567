"""The server under the faults a review found (issue 12): impossible requests, lost events,
users whose names hold a colon, and the cost of many queues. Each test's docstring names the
item it covers."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from daemon.client.pool_client import ClientError
from daemon.job import JobSpec
from daemon.queue import keys
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.server.handlers import Handlers
from protocol import (
    Enqueue,
    EnqueueBatch,
    Enqueued,
    EnqueuedBatch,
    ErrorCode,
    JobDetail,
    ShowJob,
    Waited,
    WaitJobs,
)
from tests.daemon.queue.test_scripts import counting_round_trips
from tests.support.pool import Pool, running_pool
from tests.support.workers import fake_gpus, running_worker


def job(**kw: object) -> dict[str, object]:
    return {"argv": ["true"], **kw}


async def test_a_job_no_worker_could_ever_hold_is_refused_unless_it_may_wait(
    pool: Pool, tmp_path: Path
) -> None:
    """Item 1: `enqueue --gpus 8` on a pool whose largest worker has 4 GPUs was queued, and
    stalled its queue for good. It is refused with a sentence that says why and what to do; with
    `wait_for_worker` it is queued, and the jobs behind it are not held up."""
    async with pool.client() as c:
        with pytest.raises(ClientError) as refused:
            await c.call(Enqueue(job(gpus=1), None), Enqueued)
        assert refused.value.code == ErrorCode.INVALID_ARGUMENT
        assert "no worker serving queue 'default' has joined the pool" in str(refused.value)
        async with running_worker(pool.queue, tmp_path / "w", gpus=fake_gpus(4), slots=2):
            with pytest.raises(ClientError) as refused:
                await c.call(EnqueueBatch([job(), job(gpus=8)]), EnqueuedBatch)
            assert str(refused.value).startswith(
                "needs 8 GPUs; the largest worker serving queue 'default' has 4."
            )
            assert "--wait-for-worker" in str(refused.value)
            with pytest.raises(ClientError) as refused:  # memory on one GPU: 20 GiB of a 16 GiB GPU
                await c.call(Enqueue(job(gpu_mem=20 * 2**30), None), Enqueued)
            assert str(refused.value).startswith(
                "needs 20.0 GiB on one GPU; the largest worker serving queue 'default' has a GPU of "
                "16.0 GiB at most."
            )
            assert await pool.queue.list_jobs() == []  # nothing of the refused batch was queued
            big = await c.call(Enqueue(job(gpus=8, wait_for_worker=True), None), Enqueued)
            after = await c.call(Enqueue(job(), None), Enqueued)
            done = await c.call(WaitJobs([after.job_id], 30), Waited)
            assert [j["state"] for j in done.jobs] == ["succeeded"]
            detail = (await c.call(ShowJob(big.job_id), JobDetail)).job
            assert detail["state"] == "queued"
            assert detail["pending_reason"].startswith("needs 8 GPUs, and no live worker has that many")


async def test_wait_ends_even_when_the_event_of_the_end_is_never_seen(pool: Pool) -> None:
    """Item 7: `wait` relied on the terminal event alone, and the events reader could skip one
    (at server start it took "newest" as its cursor); the waiter then hung. Here the job ends
    without any event at all (its record is made terminal directly): the wait still returns."""
    async with pool.client() as c:
        submitted = await c.call(Enqueue(job(), None), Enqueued)
        waiting = asyncio.create_task(c.call(WaitJobs([submitted.job_id], None), Waited))
        await asyncio.sleep(0.3)
        await pool.queue.redis.hset(keys.job(submitted.job_id), "state", "succeeded")
        done = await asyncio.wait_for(waiting, 10)
    assert [j["state"] for j in done.jobs] == ["succeeded"]


async def test_users_whose_names_hold_a_colon_keep_their_idempotency_keys_apart(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """Item 13: the server built idempotency keys as `user:key`, so user `a:b` with key `c` and
    user `a` with key `b:c` got each other's job."""
    async with running_pool(redis_server, tmp_path, users=("a:b", "a")) as p:
        async with p.client("a:b") as first:
            one = await first.call(Enqueue(job(), "c"), Enqueued)
        async with p.client("a") as second:
            other = await second.call(Enqueue(job(), "b:c"), Enqueued)
    assert other.created
    assert other.job_id != one.job_id


async def test_an_idle_server_reads_the_queue_set_once_a_second_whatever_the_queues(
    pool: Pool, redis: Redis
) -> None:
    """Item 12: the events reader ran SMEMBERS and an XREAD over every queue's events every
    100 ms, idle or not."""
    await pool.queue.enqueue_many([JobSpec(argv=("true",), queue=f"q{i}") for i in range(100)])
    await asyncio.sleep(1.5)  # the reader has seen the 100 queues
    before = await _calls(redis)
    await asyncio.sleep(3)
    after = await _calls(redis)
    assert after.get("smembers", 0) - before.get("smembers", 0) <= 4
    assert after.get("xread", 0) - before.get("xread", 0) <= 4


async def test_the_reaper_and_the_metrics_take_one_round_trip_for_all_queues(redis: Redis) -> None:
    """Item 12: the reaper and the metrics made one sequential round trip per queue."""
    queue = JobQueue(redis, lease_seconds=30)
    names = [f"q{i}" for i in range(100)]
    await queue.enqueue_many([JobSpec(argv=("true",), queue=q) for q in names])
    await queue.reclaim(names[:2])  # the script loaded
    sent = counting_round_trips(redis)
    assert await queue.reclaim(names) == []
    assert await queue.depths(names) == dict.fromkeys(names, 1)
    assert len(sent) == 2


async def _calls(redis: Redis) -> dict[str, int]:
    stats = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


async def test_a_connection_whose_request_ends_slowly_is_still_closed_at_the_stop(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session's end awaited its requests' ends, then closed its transport; the listener's stop
    cancels a session again every RECANCEL_SECONDS (50 ms) until it has ended, and a second
    cancellation during that wait skipped the close: a request whose end takes longer (a relay's
    clean-up, a slow Redis) left its connection open past the stop, to the garbage collector
    (an "unclosed transport" warning in a later test, and a descriptor closed whenever the
    collector ran, by then maybe another connection's). The transport is closed whatever."""
    handle = Handlers.handle

    async def slow_to_end(self: Handlers, *args: Any, **kwargs: Any) -> Any:
        try:
            return await handle(self, *args, **kwargs)
        except asyncio.CancelledError:
            loop = asyncio.get_running_loop()
            until = loop.time() + 0.3  # its clean-up takes a while, cancelled again or not
            while loop.time() < until:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(until - loop.time())
            raise

    monkeypatch.setattr(Handlers, "handle", slow_to_end)
    async with pool.client() as c:
        job_id = (await c.call(Enqueue(job(), None), Enqueued)).job_id  # no worker: it stays queued
        waiting = asyncio.create_task(c.call(WaitJobs([job_id], None), Waited))
        await asyncio.sleep(0.2)  # the wait is in flight on the server
        assert pool.server.listener is not None
        await pool.server.listener.stop(grace=0.0)
        async with asyncio.timeout(5):  # the server closed its end: the client sees it
            while c.closed is None:
                await asyncio.sleep(0.02)
        with pytest.raises(ClientError):
            await waiting
