"""The pool server over real TCP: requests, streams, users, and the stand-in worker of this tier
(the test claims and completes jobs through the queue, as a worker would)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from daemon.client.pool_client import AuthFailed, ClientError
from daemon.job import JobState, Outcome
from daemon.queue.claims import Capacity
from daemon.queue.embedded_redis import EmbeddedRedis
from protocol import (
    CancelJobs,
    Cancelled,
    Enqueue,
    EnqueueBatch,
    Enqueued,
    EnqueuedBatch,
    ErrorCode,
    FollowLogs,
    JobDetail,
    JobEnded,
    JobList,
    ListJobs,
    LogChunk,
    LogEnd,
    Ping,
    Pong,
    ShowJob,
    Waited,
    WaitJobs,
)
from tests.support.pool import Pool, running_pool


def job(*argv: str, **kw: object) -> dict[str, object]:
    return {"argv": list(argv) or ["true"], **kw}


async def test_submit_list_show_cancel(pool: Pool) -> None:
    async with pool.client() as c:
        first = await c.call(Enqueue(job("python", "train.py", name="train"), None), Enqueued)
        second = await c.call(Enqueue(job("echo"), None), Enqueued)
        listed = await c.call(ListJobs(None, None, False, 100), JobList)
        assert [j["id"] for j in listed.jobs] == [first.job_id, second.job_id]
        detail = (await c.call(ShowJob(first.job_id), JobDetail)).job
        assert detail["spec"]["argv"] == ["python", "train.py"]
        assert detail["spec"]["user"] == "alice"
        assert detail["state"] == "queued"
        assert (
            detail["pending_reason"] == "no live worker serves queue 'default' (when one does: next to start)"
        )

        states = await c.call(CancelJobs([second.job_id, "default.doesnotexist1"]), Cancelled)
        assert states.states == {second.job_id: "cancelled", "default.doesnotexist1": "not_found"}
        only_cancelled = await c.call(ListJobs(None, "cancelled", False, 100), JobList)
        assert [j["id"] for j in only_cancelled.jobs] == [second.job_id]

        with pytest.raises(ClientError) as err:
            await c.call(ShowJob("default.doesnotexist1"), JobDetail)
        assert err.value.code == ErrorCode.NOT_FOUND
        with pytest.raises(ClientError) as err:
            await c.call(Enqueue({"argv": []}, None), Enqueued)
        assert err.value.code == ErrorCode.INVALID_ARGUMENT
        assert "argv" in str(err.value)
        # the connection survives request-level errors
        assert isinstance(await c.call(Ping(), Pong), Pong)


async def test_idempotency_keys_are_per_user(pool: Pool) -> None:
    async with pool.client("alice") as a, pool.client("bob") as b:
        a1 = await a.call(Enqueue(job(), "nightly"), Enqueued)
        a2 = await a.call(Enqueue(job(), "nightly"), Enqueued)
        b1 = await b.call(Enqueue(job(), "nightly"), Enqueued)
    assert (a1.job_id, a1.created, a2.created) == (a2.job_id, True, False)
    assert b1.job_id != a1.job_id
    assert b1.created


async def test_two_users_see_their_own_names_on_jobs(pool: Pool) -> None:
    async with pool.client("alice") as a, pool.client("bob") as b:
        ja = (await a.call(Enqueue(job(), None), Enqueued)).job_id
        jb = (await b.call(Enqueue(job(), None), Enqueued)).job_id
        with pytest.raises(ClientError, match="user"):  # a client cannot claim to be someone else
            await b.call(Enqueue(job(user="alice"), None), Enqueued)
        jobs = {
            j["id"]: j["spec"]["user"] for j in (await a.call(ListJobs(None, None, False, 10), JobList)).jobs
        }
    assert jobs == {ja: "alice", jb: "bob"}


async def test_many_concurrent_requests_on_one_connection(pool: Pool) -> None:
    async with pool.client() as c:
        first = (await c.call(Enqueue(job(), None), Enqueued)).job_id
        waiting = asyncio.create_task(c.call(WaitJobs([first], None), Waited))  # stays in flight
        ids = await asyncio.gather(
            *(c.call(Enqueue(job("echo", str(i)), None), Enqueued) for i in range(100))
        )
        assert len({r.job_id for r in ids}) == 100
        batch = await c.call(EnqueueBatch([job("echo", str(i)) for i in range(50)]), EnqueuedBatch)
        assert len(batch.job_ids) == 50
        assert not waiting.done()
        lease = await pool.queue.claim("stand-in", ["default"])
        assert lease is not None
        assert lease.job_id == first
        await pool.queue.complete(lease, Outcome(JobState.SUCCEEDED, exit_code=0))
        waited = await asyncio.wait_for(waiting, 10)
        assert [j["state"] for j in waited.jobs] == ["succeeded"]
        assert not waited.timed_out


async def test_wait_times_out_and_reports_states(pool: Pool) -> None:
    async with pool.client() as c:
        job_id = (await c.call(Enqueue(job(), None), Enqueued)).job_id
        waited = await c.call(WaitJobs([job_id], 0.2), Waited)
    assert waited.timed_out
    assert waited.jobs[0]["state"] == "queued"


async def test_follow_logs_streams_live_and_ends_with_the_exit_code(pool: Pool) -> None:
    async with pool.client() as c:
        job_id = (await c.call(Enqueue(job("train"), None), Enqueued)).job_id
        lease = await pool.queue.claim("stand-in", ["default"])
        assert lease is not None
        await pool.queue.append_log(lease, 1, [b"epoch 1\n"])
        chunks: list[bytes] = []
        got_first = asyncio.Event()

        async def follow() -> LogEnd:
            async for item in c.stream(FollowLogs(job_id, True, "")):
                if isinstance(item, LogChunk):
                    chunks.append(item.data)
                    got_first.set()
                elif isinstance(item, LogEnd):
                    return item
            raise AssertionError("no LogEnd")

        follower = asyncio.create_task(follow())
        await asyncio.wait_for(got_first.wait(), 10)
        assert chunks == [b"epoch 1\n"]  # seen while the job still runs
        await pool.queue.append_log(lease, 2, [b"epoch 2\n"])
        await pool.queue.complete(lease, Outcome(JobState.FAILED, exit_code=3))
        end = await asyncio.wait_for(follower, 10)
    assert chunks == [b"epoch 1\n", b"epoch 2\n"]
    assert (end.state, end.exit_code) == ("failed", 3)


async def test_wrong_token_and_unknown_user_get_the_same_refusal(pool: Pool) -> None:
    messages = []
    for user, token in [("alice", "not-the-token-at-all"), ("mallory", "not-the-token-at-all")]:
        client = pool.client("alice", token)
        client.user = user
        client.conn = type(client.conn)(user, token.encode())
        with pytest.raises(AuthFailed) as err:
            await client.connect()
        await client.close()
        messages.append(str(err.value).replace(repr(user), "USER"))
    assert messages[0] == messages[1]
    async with pool.client("bob") as ok:  # the server is unaffected
        assert isinstance(await ok.call(Ping(), Pong), Pong)


async def test_a_second_server_on_a_taken_port_says_so(pool: Pool) -> None:
    import dataclasses

    from daemon.server.listener import ListenerError
    from daemon.server.service import PoolServer

    taken = dataclasses.replace(pool.server.config, listen=pool.address)
    second = PoolServer(taken)
    with pytest.raises(ListenerError) as err:
        await second.start()
    await second.stop()
    assert str(err.value) == (
        f"cannot listen on {pool.address}: address already in use (is a pool already running here?); "
        "choose another address with --listen HOST:PORT"
    )


async def test_a_request_after_the_servers_goodbye_is_a_clear_client_error(pool: Pool) -> None:
    # A request in flight keeps the stopping server's connection open (the drain): the client has
    # heard GOODBYE but is still connected, and a new request must say so, not raise a protocol bug.
    async with pool.client() as c:
        queued = await c.call(Enqueue(job("sleep", "300"), None), Enqueued)
        waiting = asyncio.ensure_future(c.call(WaitJobs([queued.job_id], None), Waited))
        await asyncio.sleep(0.1)
        assert pool.server.listener is not None
        stopping = asyncio.ensure_future(pool.server.listener.stop(grace=5))
        for _ in range(200):  # bounded: until the GOODBYE has arrived
            if c.conn.state.name == "CLOSING":
                break
            await asyncio.sleep(0.01)
        with pytest.raises(ClientError, match="closing this connection; connect again"):
            await c.call(Ping(), Pong)
        waiting.cancel()
        await asyncio.gather(waiting, stopping, return_exceptions=True)


async def test_show_says_a_job_waits_for_its_user_to_be_below_the_cap(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    async with running_pool(redis_server, tmp_path, user_max_running_jobs=1) as pool:
        async with pool.client("alice") as alice:
            ids = [(await alice.call(Enqueue(job(), None), Enqueued)).job_id for _ in range(2)]
        async with pool.client("bob") as bob:
            theirs = (await bob.call(Enqueue(job(), None), Enqueued)).job_id
        claimed = await pool.queue.claim_many("w1", ["default"], 3)  # as the worker would
        assert [lease.job_id for lease in claimed] == [ids[0], theirs]
        async with pool.client("alice") as alice:
            detail = (await alice.call(ShowJob(ids[1]), JobDetail)).job
        assert detail["pending_reason"] == (
            "alice is at the cap of 1 running jobs per user in queue 'default': it starts, before "
            "the jobs behind it, once one of theirs there ends"
        )


async def test_show_says_a_head_job_is_reserved_on_a_worker_and_when_it_could_start(pool: Pool) -> None:
    async with pool.client() as c:
        running = (
            await c.call(Enqueue(job(gpus=2, timeout=600, wait_for_worker=True), None), Enqueued)
        ).job_id
        assert [
            x.job_id for x in await pool.queue.claim_many("w1", ["default"], 1, Capacity(4, gpus_total=4))
        ] == [running]
        head = (await c.call(Enqueue(job(gpus=4, wait_for_worker=True), None), Enqueued)).job_id
        # as the worker would claim: 2 GPUs free, the other 2 busy for 600 s at most
        assert (
            await pool.queue.claim_many("w1", ["default"], 1, Capacity(2, gpus_total=4, ends=[(600, 2)]))
            == []
        )
        reason = (await c.call(ShowJob(head), JobDetail)).job["pending_reason"]
    assert reason.startswith("waiting for 4 GPUs; reserved on w1, expected by ")
    assert reason.endswith(
        "when its running jobs' time limits end; jobs behind it start meanwhile where they cannot delay it"
    )


async def _job_reads(pool: Pool) -> int:
    stats = await pool.queue.redis.info("commandstats")
    return int(stats.get("cmdstat_hgetall", {}).get("calls", 0))


async def test_a_wait_reads_each_job_as_it_ends_not_every_job_at_every_end(pool: Pool) -> None:
    """Issue 48's map waits on many jobs in one WaitJobs: the server read every job it waited for
    at each end, N jobs N times over (150 jobs ending one by one: ~11,000 reads). It reads the job
    that ended, and every job still waited for only at each WAIT_RECHECK."""
    count = 150
    async with pool.client() as c:
        ids = (await c.call(EnqueueBatch([job("echo", str(i)) for i in range(count)]), EnqueuedBatch)).job_ids
        leases = [await pool.queue.claim("stand-in", ["default"]) for _ in ids]
        before = await _job_reads(pool)

        async def end_one() -> None:  # the last claimed first: each end is some other job than the next
            lease = leases.pop()
            assert lease is not None
            await pool.queue.complete(lease, Outcome(JobState.SUCCEEDED, exit_code=0))

        waited = None
        await end_one()
        async with asyncio.timeout(60):  # a bound: each end is told at once, not at a recheck
            async for item in c.stream(WaitJobs(ids, None)):
                if isinstance(item, JobEnded):
                    if leases:  # the next ends once the server has told of this one
                        await end_one()
                else:
                    waited = item
    reads = await _job_reads(pool) - before
    assert isinstance(waited, Waited)
    assert [j["state"] for j in waited.jobs] == ["succeeded"] * count
    assert reads < 4 * count, reads
