"""Job-end notifications under faults (issue 43 item 7, webhooks): a server down for long, a Redis
that refuses a write, a server SIGKILLed in the middle of a POST, two servers racing for the same
ends. Real servers (in this loop, and a `poold` process where it is killed), a real Redis, and a
real receiver (tests/support/webhooks.py)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis

from daemon.job import JobState, Outcome
from daemon.queue import keys
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.queue.scripts import source
from daemon.server import notifier
from protocol import CancelJobs, Cancelled, Enqueue, Enqueued
from tests.support.faults import memory_full
from tests.support.pool import Pool, running_pool
from tests.support.poold_proc import poold_process
from tests.support.webhooks import Post, receiver
from tests.support.workers import sh

TOKENS = {"alice": "alice-token-0123456789abcdef"}
QUICK = 0.5  # notify_timeout: a server's hold on a delivery lapses after 6 times this
LOOPBACK = ["127.0.0.1/32"]  # notify_allow: the receivers are on loopback, which a pool refuses


async def enqueue(pool: Pool, **spec: Any) -> str:
    async with pool.client() as c:
        return (await c.call(Enqueue({"argv": ["true"], **spec}, None), Enqueued)).job_id


async def end_alone(queue: JobQueue, job_id: str) -> None:
    """End `job_id` as a worker would, with no server involved: claim it, then record a success."""
    lease = await queue.claim("stand-in", ["default"])
    assert lease is not None
    assert lease.job_id == job_id
    await queue.complete(lease, Outcome(JobState.SUCCEEDED, exit_code=0))


async def until(check: Callable[[], bool | Awaitable[bool]], seconds: float = 15) -> None:
    async with asyncio.timeout(seconds):
        while True:
            done = check()
            if not isinstance(done, bool):
                done = await done
            if done:
                return
            await asyncio.sleep(0.05)


def counted(pool: Pool, outcome: str) -> float:
    value = pool.server.metrics.registry.get_sample_value("gpupool_notifications_total", {"outcome": outcome})
    return value or 0.0


class SixteenMinutesOn(ModuleType):
    """The `time` module as a server sees it that starts 16 minutes after a job ended: its
    wall clock is that much later; the rest is the real module's."""

    def __init__(self) -> None:
        super().__init__("time")

    def time(self) -> float:
        return time.time() + 16 * 60

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


async def test_an_end_while_the_only_server_was_down_for_long_is_sent_after_its_restart(
    redis_server: EmbeddedRedis, tmp_path: Path, queue: JobQueue, monkeypatch: Any
) -> None:
    """issue 43 item 7 (webhooks): a job that ended while the pool's only server was down for more
    than the 15 minutes a start used to catch up on is notified, to its --notify URL and to the
    pool's notify_url, once a server starts again. The downtime is the notifier's clock: it starts
    16 minutes after the end as far as it can tell (the catch-up window of before read that
    clock; the outbox reads none, so how long no server ran does not matter to it)."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    async with receiver() as pool_hook, receiver() as job_hook:
        async with running_pool(
            redis_server, tmp_path / "a", notify_url=pool_hook.url, notify_allow=LOOPBACK
        ) as a:
            job_id = await enqueue(a, notify=job_hook.url)
        await end_alone(queue, job_id)  # no server runs
        monkeypatch.setattr(notifier, "time", SixteenMinutesOn(), raising=False)
        async with running_pool(
            redis_server, tmp_path / "b", notify_url=pool_hook.url, notify_allow=LOOPBACK
        ) as b:
            (to_pool,) = await pool_hook.wait_for(1, 10)
            (to_job,) = await job_hook.wait_for(1, 10)
            await until(lambda: counted(b, "sent") == 2)
    assert (to_pool.delivery, to_job.delivery) == (f"{job_id}/pool", f"{job_id}/job")
    assert orjson.loads(to_pool.body)["state"] == orjson.loads(to_job.body)["state"] == "succeeded"


async def test_a_redis_error_while_preparing_a_send_does_not_drop_it(
    redis_server: EmbeddedRedis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """issue 43 item 7 (webhooks): a Redis that refuses the server's writes (at its maxmemory)
    just as a job's end is to be sent does not lose that end: it is sent once Redis has room."""

    def refused() -> bool:  # the server met the refusal, and said so
        return any(r.name == notifier.__name__ and "maxmemory" in r.getMessage() for r in caplog.records)

    async with (
        receiver() as hook,
        running_pool(redis_server, tmp_path, notify_timeout=QUICK, notify_allow=LOOPBACK) as pool,
    ):
        job_id = await enqueue(pool, notify=hook.url)
        lease = await pool.queue.claim("stand-in", ["default"])
        assert lease is not None
        async with memory_full(redis_server):
            await pool.queue.complete(lease, Outcome(JobState.SUCCEEDED, exit_code=0))  # allowed when full
            await until(refused)
            assert hook.posts == []
        (post,) = await hook.wait_for(1, 10)
        await until(lambda: counted(pool, "sent") == 1)
    assert post.delivery == f"{job_id}/job"


async def test_a_server_sigkilled_during_a_delivery_leaves_it_to_the_next(
    redis_server: EmbeddedRedis, tmp_path: Path, queue: JobQueue
) -> None:
    """issue 43 item 7 (webhooks): a `poold` SIGKILLed while its POST of a job's end is under way
    does not take that end with it: another server delivers it (at least once)."""
    (tmp_path / "b").mkdir()
    async with receiver() as hook:
        hook.hold = asyncio.Event()  # the first POST hangs: the server is killed in the middle of it
        job_id, _ = await queue.enqueue(sh("true", user="alice", notify=hook.url))
        with poold_process(
            redis_server,
            tmp_path / "a",
            TOKENS,
            "--notify-timeout",
            str(QUICK),
            "--notify-allow",
            "127.0.0.1/32",
        ) as (_, a):
            await end_alone(queue, job_id)
            (first,) = await hook.wait_for(1)
            a.kill()
            await asyncio.to_thread(a.wait, 30)
        hook.hold.set()
        async with running_pool(
            redis_server, tmp_path / "b", notify_timeout=QUICK, notify_allow=LOOPBACK
        ) as b:
            first, second = await hook.wait_for(2)
            await until(lambda: counted(b, "sent") == 1)
    assert first.delivery == second.delivery == f"{job_id}/job"
    assert first.body == second.body


async def test_two_servers_deliver_each_end_once_its_retry_included(
    redis_server: EmbeddedRedis, tmp_path: Path, queue: JobQueue
) -> None:
    """issue 43 item 7 (webhooks): two servers of one pool, started together after ends that came
    while none ran and seeing the ends that come while both run, POST each end once, and retry
    the one refused once: every delivery is exactly a 503, then a 200."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()

    def refuse_first(delivery: str, before: list[Post]) -> int:
        return 200 if before else 503

    async with receiver(answer=refuse_first) as hook:
        spec = sh("true", user="alice", notify=hook.url)
        early = [(await queue.enqueue(spec))[0] for _ in range(10)]
        for job_id in early:
            await queue.cancel(job_id)  # ended while no server runs
        async with contextlib.AsyncExitStack() as stack:
            a, b = await asyncio.gather(
                stack.enter_async_context(
                    running_pool(redis_server, tmp_path / "a", notify_timeout=QUICK, notify_allow=LOOPBACK)
                ),
                stack.enter_async_context(
                    running_pool(redis_server, tmp_path / "b", notify_timeout=QUICK, notify_allow=LOOPBACK)
                ),
            )
            late = [(await queue.enqueue(spec))[0] for _ in range(10)]
            async with a.client() as c:
                await c.call(CancelJobs(late), Cancelled)  # each end seen by both servers
            await hook.wait_for(40)
            await until(lambda: counted(a, "sent") + counted(b, "sent") == 20)
            await asyncio.sleep(notifier.FIRST_RETRY + 2 * QUICK)  # when a second retry would come
    for job_id in early + late:
        assert [p.answered for p in hook.of(f"{job_id}/job")] == [503, 200], job_id
    assert len(hook.posts) == 40


async def test_an_end_past_job_retention_is_not_sent_and_is_counted(
    redis_server: EmbeddedRedis, tmp_path: Path, redis: Redis
) -> None:
    """issue 43 item 7 (webhooks): the catch-up bound. An end whose job's record has expired
    (job_retention after the end) before any server came to it has nothing left to send: it is
    dropped, counted and logged, not kept for ever."""
    short = JobQueue(redis, lease_seconds=30, retention_seconds=1)
    async with receiver() as hook:
        job_id, _ = await short.enqueue(sh("true", user="alice", notify=hook.url))
        await short.cancel(job_id)
        await until(lambda: gone(redis, keys.job(job_id)), 10)
        async with running_pool(
            redis_server, tmp_path, notify_timeout=QUICK, job_retention=1, notify_allow=LOOPBACK
        ) as pool:
            await until(lambda: counted(pool, "dropped") == 1)
            assert await redis.zcard(keys.outbox("default")) == 0
        assert hook.posts == []


async def gone(redis: Redis, key: str) -> bool:
    return not await redis.exists(key)


async def test_a_full_outbox_drops_its_oldest_end_and_the_next_server_says_so(
    redis_server: EmbeddedRedis, tmp_path: Path, queue: JobQueue, redis: Redis
) -> None:
    """issue 43 item 7 (webhooks): the outbox is bounded per queue. At its cap a job's end pushes
    out the one due longest ago, which is counted; a server reports it (metrics, log) and still
    sends the new end."""
    found = re.search(r"OUTBOX_MAX = (\d+)", source("complete"))
    assert found is not None
    cap = int(found[1])
    outbox = keys.outbox("default")
    past = int(time.time() * 1000) - 3_600_000
    fake = [f"default.old{i}/job" for i in range(cap)]
    for start in range(0, cap, 10_000):
        await redis.zadd(outbox, {m: past + i for i, m in enumerate(fake[start : start + 10_000], start)})
    async with receiver() as hook:
        job_id, _ = await queue.enqueue(sh("true", user="alice", notify=hook.url))
        await queue.cancel(job_id)
        assert await redis.zcard(outbox) == cap
        assert await redis.zscore(outbox, fake[0]) is None  # the oldest, pushed out
        assert await redis.zscore(outbox, fake[1]) is not None
        assert await redis.zscore(outbox, f"{job_id}/job") is not None
        for start in range(1, cap, 10_000):
            await redis.zrem(outbox, *fake[start : start + 10_000])
        async with running_pool(redis_server, tmp_path, notify_timeout=QUICK, notify_allow=LOOPBACK) as pool:
            (post,) = await hook.wait_for(1, 10)
            await until(lambda: counted(pool, "dropped") == 1 and counted(pool, "sent") == 1)
    assert post.delivery == f"{job_id}/job"
