"""Job-end notifications (daemon/server/notifier.py): a real server on a real Redis POSTs to a real
HTTP receiver on 127.0.0.1 (tests/support/webhooks.py), which checks the signature as any receiver
would, with hmac on the raw body."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from daemon import config
from daemon.ctl.session import ClientError
from daemon.errors import ConfigError
from daemon.job import JobState, Outcome
from daemon.queue import keys
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.server import notifier
from protocol import CancelJobs, Cancelled, Enqueue, Enqueued, ErrorCode, JobDetail, ShowJob
from tests.support import webhooks
from tests.support.pool import Pool, running_pool
from tests.support.webhooks import Post, receiver

SECRET = "notify-secret-0123456789"


def signed(post: Post, secret: str = SECRET) -> bool:
    return webhooks.signed(post, secret)


async def enqueue(pool: Pool, **spec: Any) -> str:
    async with pool.client() as c:
        return (await c.call(Enqueue({"argv": ["true"], **spec}, None), Enqueued)).job_id


async def end(pool: Pool, job_id: str, state: JobState, exit_code: int, detail: str = "") -> None:
    lease = await pool.queue.claim("stand-in", ["default"])
    assert lease is not None
    assert lease.job_id == job_id
    await pool.queue.complete(lease, Outcome(state, exit_code=exit_code, detail=detail))


async def until(check: Callable[[], bool], seconds: float = 10) -> None:
    async with asyncio.timeout(seconds):
        while not check():
            await asyncio.sleep(0.05)


def counted(pool: Pool, outcome: str) -> float:
    value = pool.server.metrics.registry.get_sample_value("gpupool_notifications_total", {"outcome": outcome})
    return value or 0.0


async def test_a_jobs_end_arrives_signed_after_a_retry(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    async with (
        receiver([500]) as hook,
        running_pool(redis_server, tmp_path, notify_secret=SECRET) as pool,
    ):
        job_id = await enqueue(pool, name="train", notify=hook.url)
        await end(pool, job_id, JobState.FAILED, 3, "exit 3")
        first, second = await hook.wait_for(2)
        await until(lambda: counted(pool, "sent") == 1)
        assert counted(pool, "failed") == counted(pool, "dropped") == 0
    assert (first.answered, second.answered) == (500, 200)
    assert first.body == second.body  # the same record, signed the same, each time
    assert signed(second)
    assert not signed(Post(second.headers, second.body + b" ", 200))  # a changed body fails the check
    record = orjson.loads(second.body)
    assert {k: record[k] for k in ("event", "id", "name", "user", "queue", "state", "exit_code")} == {
        "event": "job.ended",
        "id": job_id,
        "name": "train",
        "user": "alice",
        "queue": "default",
        "state": "failed",
        "exit_code": 3,
    }
    assert record["detail"] == "exit 3"
    assert record["attempts"] == 1
    assert record["enqueued_at"] <= record["started_at"] <= record["ended_at"]
    assert second.headers["X-Gpupool-Event"] == "job.ended"
    assert second.headers["X-Gpupool-Delivery"] == f"{job_id}/job"
    assert second.headers["Content-Type"] == "application/json"


async def test_a_job_with_no_notify_and_no_notify_url_sends_nothing(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    async with receiver() as hook, running_pool(redis_server, tmp_path) as pool:
        quiet = await enqueue(pool)
        loud = await enqueue(pool, notify=hook.url)
        async with pool.client() as c:
            await c.call(CancelJobs([quiet, loud]), Cancelled)
        (post,) = await hook.wait_for(1)  # ends are handled in order: the quiet one came first
        await until(lambda: counted(pool, "sent") == 1)
        assert await pool.queue.redis.hget(keys.job(quiet), "notify") is None  # nowhere to go:
        for target in ("job", "pool"):  # never in the outbox
            assert await pool.queue.redis.zscore(keys.outbox("default"), f"{quiet}/{target}") is None
    assert orjson.loads(post.body)["id"] == loud
    assert orjson.loads(post.body)["state"] == "cancelled"
    assert len(hook.posts) == 1
    assert "X-Gpupool-Signature" not in post.headers  # no notify_secret: unsigned


async def test_the_pool_url_gets_every_end_and_a_refusal_is_not_retried(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    secret_file = tmp_path / "notify-secret"
    secret_file.write_text(SECRET + "\n")
    loaded = config.load(None, env={"GPUPOOL_NOTIFY_SECRET_FILE": str(secret_file)}, config_file=None)
    assert loaded.notify_secret == SECRET  # as every other *_file secret is read
    async with (
        receiver() as pool_hook,
        receiver([404]) as job_hook,
        running_pool(redis_server, tmp_path, notify_url=pool_hook.url, notify_secret=SECRET) as pool,
    ):
        job_id = await enqueue(pool, notify=job_hook.url)
        await end(pool, job_id, JobState.SUCCEEDED, 0)
        (to_pool,) = await pool_hook.wait_for(1)
        (to_job,) = await job_hook.wait_for(1)
        await until(lambda: counted(pool, "failed") == 1 and counted(pool, "sent") == 1)
        await asyncio.sleep(notifier.FIRST_RETRY + 0.5)  # when a retry would have come
    assert signed(to_pool)
    assert orjson.loads(to_pool.body)["state"] == "succeeded"
    assert to_pool.headers["X-Gpupool-Delivery"] == f"{job_id}/pool"
    assert to_job.answered == 404
    assert len(job_hook.posts) == 1  # a 4xx is the receiver's answer, not a failure to retry


async def test_two_servers_of_one_pool_send_each_end_once(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    async with (
        receiver() as hook,
        running_pool(redis_server, tmp_path / "a", notify_url=hook.url) as a,
        running_pool(redis_server, tmp_path / "b", notify_url=hook.url) as b,
    ):
        ids = [await enqueue(a) for _ in range(3)]
        async with a.client() as c:
            await c.call(CancelJobs(ids), Cancelled)
        await hook.wait_for(3)
        await until(lambda: counted(a, "sent") + counted(b, "sent") == 3)
        await asyncio.sleep(0.5)
    assert sorted(orjson.loads(p.body)["id"] for p in hook.posts) == sorted(ids)


async def test_a_stopped_server_hands_back_what_it_did_not_deliver(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    async with receiver([503] * 100) as hook:
        async with running_pool(redis_server, tmp_path / "a", notify_secret=SECRET) as a:
            job_id = await enqueue(a, notify=hook.url)
            async with a.client() as c:
                await c.call(CancelJobs([job_id]), Cancelled)
            await hook.wait_for(1)  # refused, and waiting to try again when the server stops
        hook.answers.clear()
        async with running_pool(redis_server, tmp_path / "b", notify_secret=SECRET) as b:
            posts = await hook.wait_for(2)  # the next start finds it handed back to the outbox
            await until(lambda: counted(b, "sent") == 1)
    assert [p.answered for p in posts] == [503, 200]
    assert signed(posts[1])
    assert orjson.loads(posts[1].body)["id"] == job_id


async def test_a_bad_url_is_refused_at_enqueue_and_a_good_one_hidden_from_others(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    async with running_pool(redis_server, tmp_path) as pool:
        for bad in ("ftp://example.com/x", "hooks.example.com", "http://", "https://h:99999/", "http://a b"):
            with pytest.raises(ClientError) as err:
                await enqueue(pool, notify=bad)
            assert err.value.code == ErrorCode.INVALID_ARGUMENT
            assert str(err.value).startswith(f"job notify: {bad!r} is not valid: expected"), err.value
        job_id = await enqueue(pool, notify="https://hooks.example.com/gpupool/TOKEN")
        async with pool.client("bob") as bob:
            assert (await bob.call(ShowJob(job_id), JobDetail)).job["spec"]["notify"] == "<hidden>"
        async with pool.client("alice") as alice:
            shown = (await alice.call(ShowJob(job_id), JobDetail)).job["spec"]["notify"]
            assert shown == "https://hooks.example.com/gpupool/TOKEN"
    with pytest.raises(ConfigError, match="notify_url: 'ftp://x' is not valid: expected an http"):
        config.load(None, env={"GPUPOOL_NOTIFY_URL": "ftp://x"}, config_file=None)
