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
from daemon.client.session import ClientError
from daemon.errors import ConfigError
from daemon.job import JobSpec, JobState, Outcome
from daemon.queue import keys
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.server import notifier
from protocol import CancelJobs, Cancelled, Enqueue, Enqueued, ErrorCode, JobDetail, ShowJob
from tests.support import webhooks
from tests.support.pool import Pool, running_pool
from tests.support.webhooks import Post, receiver

SECRET = "notify-secret-0123456789"
LOOPBACK = ["127.0.0.1/32"]  # notify_allow: the receivers are on loopback, which a pool refuses


def signed(post: Post, secret: str | bytes = SECRET, now: float | None = None) -> bool:
    return webhooks.signed(post, secret, now)


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
        running_pool(redis_server, tmp_path, notify_secret=SECRET, notify_allow=LOOPBACK) as pool,
    ):
        alice = webhooks.user_key(pool.tokens["alice"])
        job_id = await enqueue(pool, name="train", notify=hook.url)
        await end(pool, job_id, JobState.FAILED, 3, "exit 3")
        first, second = await hook.wait_for(2)
        await until(lambda: counted(pool, "sent") == 1)
        assert counted(pool, "failed") == counted(pool, "dropped") == 0
    assert (first.answered, second.answered) == (500, 200)
    assert first.body == second.body  # the same record each time, signed when sent
    assert signed(second, alice)  # a job's own hook: signed with its user's key
    assert not signed(Post(second.headers, second.body + b" ", 200), alice)  # a changed body fails
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
    async with receiver() as hook, running_pool(redis_server, tmp_path, notify_allow=LOOPBACK) as pool:
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
        running_pool(
            redis_server, tmp_path, notify_url=pool_hook.url, notify_secret=SECRET, notify_allow=LOOPBACK
        ) as pool,
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
        async with running_pool(redis_server, tmp_path / "a", notify_allow=LOOPBACK) as a:
            job_id = await enqueue(a, notify=hook.url)
            async with a.client() as c:
                await c.call(CancelJobs([job_id]), Cancelled)
            await hook.wait_for(1)  # refused, and waiting to try again when the server stops
        hook.answers.clear()
        async with running_pool(redis_server, tmp_path / "b", notify_allow=LOOPBACK) as b:
            posts = await hook.wait_for(2)  # the next start finds it handed back to the outbox
            await until(lambda: counted(b, "sent") == 1)
            alice = webhooks.user_key(b.tokens["alice"])
    assert [p.answered for p in posts] == [503, 200]
    assert signed(posts[1], alice)
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


async def test_a_hook_to_an_internal_address_is_refused_at_enqueue_naming_notify_allow(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 44 item 5: a user's --notify URL could name the server's loopback services (its
    metrics, its Redis), the metadata service at 169.254.169.254 or the internal network. Now
    an address in the URL that is not public is refused at enqueue, with a sentence naming
    notify_allow; what notify_allow lists is taken, and only that. The host judged is the one the
    HTTP client connects to: a full-width dot ("127。0。0。1") passed the check, and was POSTed
    to as 127.0.0.1 (found in review)."""
    for name in ("closed", "open"):
        (tmp_path / name).mkdir()
    async with running_pool(redis_server, tmp_path / "closed") as pool:
        metrics = pool.server.metrics_server
        assert metrics is not None
        internal = [
            f"http://127.0.0.1:{metrics.port}/metrics",
            f"http://127.0.0.1:{redis_server.port}/",
            "http://169.254.169.254/latest/meta-data/",
            "http://10.1.2.3/hook",
            "http://192.168.0.1/hook",
            "http://100.64.0.1/hook",
            "http://0.0.0.0/hook",
            "http://224.0.0.1/hook",
            f"http://[::1]:{metrics.port}/metrics",
            f"http://[::ffff:127.0.0.1]:{metrics.port}/metrics",
            "http://[fe80::1]/hook",
            "http://[fd00::1]/hook",
            # Forms the HTTP client reads as an address though the URL parser does not (IDNA maps
            # the ideographic full stop to a dot), or reads leniently (inet_aton's short forms).
            f"http://127\u30020\u30020\u30021:{metrics.port}/metrics",
            "http://169\u3002254\u3002169\u3002254/latest/meta-data/",
            f"http://127.0.0.1.:{metrics.port}/metrics",
            f"http://127.1:{metrics.port}/metrics",
            f"http://2130706433:{metrics.port}/metrics",
        ]
        for url in internal:
            with pytest.raises(ClientError) as err:
                await enqueue(pool, notify=url)
            assert err.value.code == ErrorCode.INVALID_ARGUMENT, url
            assert str(err.value).startswith(f"job notify: {url!r}: "), err.value
            assert "notify_allow" in str(err.value), err.value
        assert "169.254.169.254 is a link-local address" in str(
            await refusal(pool, "http://169.254.169.254/latest/meta-data/")
        )
        await enqueue(pool, notify="http://8.8.8.8/hook")  # a public address is taken
    async with running_pool(redis_server, tmp_path / "open", notify_allow=["10.0.0.0/8"]) as pool:
        await enqueue(pool, notify="http://10.1.2.3/hook")
        with pytest.raises(ClientError):
            await enqueue(pool, notify="http://169.254.169.254/latest/meta-data/")


async def test_a_name_that_resolves_to_loopback_is_refused_at_delivery_unless_allowed(
    redis_server: EmbeddedRedis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """issue 44 item 5: the server POSTed a user's hook to whatever its name resolved to, loopback
    included, and the metrics said whether the target answered. Now a name is looked up once, when
    its POST is sent, and a delivery with no allowed address is never attempted: counted
    `refused` whether or not something listens there, logged for the operator. So is an address
    in the URL of a job queued without the enqueue's check (one from before it). notify_allow
    lets the same hooks through."""
    for name in ("closed", "open"):
        (tmp_path / name).mkdir()
    async with receiver() as hook:
        by_name = hook.url.replace("127.0.0.1", "localhost")
        nobody = "http://localhost:1/x"  # nothing listens there
        async with running_pool(redis_server, tmp_path / "closed") as pool:
            answered = await enqueue(pool, notify=by_name)  # a name: judged when it is sent
            unanswered = await enqueue(pool, notify=nobody)
            unchecked, _ = await pool.queue.enqueue(JobSpec(argv=("true",), user="alice", notify=hook.url))
            async with pool.client() as c:
                await c.call(CancelJobs([answered, unanswered, unchecked]), Cancelled)
            await until(lambda: counted(pool, "refused") == 3)
            await asyncio.sleep(0.5)  # when a POST would have come
            assert counted(pool, "sent") == counted(pool, "failed") == 0
            assert hook.posts == []
            said = [r.getMessage() for r in caplog.records if r.name == notifier.__name__]
            assert any(
                "not notifying http://localhost" in m and "127.0.0.1 (loopback)" in m and "notify_allow" in m
                for m in said
            ), said
        async with running_pool(
            redis_server, tmp_path / "open", notify_allow=["127.0.0.1/32", "::1/128"]
        ) as pool:
            ids = [await enqueue(pool, notify=url) for url in (hook.url, by_name)]
            async with pool.client() as c:
                await c.call(CancelJobs(ids), Cancelled)
            await hook.wait_for(2)
            await until(lambda: counted(pool, "sent") == 2)
    assert counted(pool, "refused") == 0


async def refusal(pool: Pool, url: str) -> ClientError:
    try:
        await enqueue(pool, notify=url)
    except ClientError as exc:
        return exc
    raise AssertionError(f"{url} was accepted")


async def test_a_users_hook_is_signed_with_their_own_key_and_a_timestamp(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 44 item 9: a user's own hook was signed with the pool's notify_secret, byte for byte
    what the pool's receiver gets, with no time in it: a user learnt how the pool's receiver
    checks and could replay it. Now each POST carries its time, signed with the body, and a
    user's hook is signed with a key made from that user's token (which they hold), never with
    the pool's secret; the pool's notify_url keeps the pool's."""
    async with (
        receiver() as pool_hook,
        receiver() as job_hook,
        running_pool(
            redis_server,
            tmp_path,
            notify_url=pool_hook.url,
            notify_secret=SECRET,
            notify_allow=LOOPBACK,
            users=("alice", "bob"),
        ) as pool,
    ):
        alice, bob = (webhooks.user_key(pool.tokens[u]) for u in ("alice", "bob"))
        job_id = await enqueue(pool, notify=job_hook.url)
        async with pool.client() as c:
            await c.call(CancelJobs([job_id]), Cancelled)
        (to_pool,) = await pool_hook.wait_for(1)
        (to_job,) = await job_hook.wait_for(1)
    assert signed(to_pool, SECRET)
    assert signed(to_job, alice)
    assert not signed(to_job, SECRET)  # what alice's hook gets is no POST the pool's receiver takes
    assert not signed(to_pool, alice)
    assert not signed(to_job, bob)
    sent_at = int(to_job.headers["X-Gpupool-Timestamp"])
    assert not signed(to_job, alice, now=sent_at + 301)  # replayed after five minutes: refused
    later = {**to_job.headers, "X-Gpupool-Timestamp": str(sent_at + 200)}
    assert not signed(Post(later, to_job.body, 200), alice, now=sent_at + 301)  # its time is signed
    assert to_job.headers["X-Gpupool-Signature"].startswith("v1=")
