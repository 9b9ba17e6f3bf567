"""One user, or anyone who can open a socket, cannot take the pool from everyone else (issue 14,
finding 9): silent sockets cannot hold the places of users who authenticate, one user's blocking
reads are bounded, and a request cannot carry millions of ids. Real server, real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from daemon.client.pool_client import ClientError, PoolClient
from daemon.job import JobSpec
from daemon.listing import FIELD_CHARS, MORE
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.server.handlers import MAX_BLOCKING_PER_USER, MAX_CHANNELS_PER_USER, MAX_IDS
from daemon.server.session import FrameBudget, Limits
from protocol import (
    CancelJobs,
    Cancelled,
    ChannelClosed,
    Enqueue,
    EnqueueBatch,
    Enqueued,
    EnqueuedBatch,
    ErrorCode,
    FollowLogs,
    JobList,
    ListJobs,
    LogEnd,
    OpenChannel,
    Ping,
    Pong,
)
from tests.support.pool import Pool, running_pool
from tests.support.poolctl import poolctl

MAX_CONNECTIONS = 20
MiB = 1024 * 1024
PER_USER = 5


@pytest.fixture
async def small_pool(redis_server: EmbeddedRedis, tmp_path: Path) -> AsyncIterator[Pool]:
    async with running_pool(
        redis_server, tmp_path, max_connections=MAX_CONNECTIONS, max_connections_per_user=PER_USER
    ) as p:
        yield p


async def test_silent_sockets_cannot_lock_users_out(small_pool: Pool) -> None:
    host, port = small_pool.address.rsplit(":", 1)
    silent = [await asyncio.open_connection(host, int(port)) for _ in range(MAX_CONNECTIONS * 2)]
    try:
        async with small_pool.client("alice") as alice:  # the oldest silent ones made room
            assert isinstance(await alice.call(Ping(), Pong), Pong)

        async def was_evicted(reader: asyncio.StreamReader) -> bool:
            with contextlib.suppress(TimeoutError, ConnectionError):
                return b"authenticating" in await asyncio.wait_for(reader.read(), 1)
            return False

        evicted = sum(await asyncio.gather(*(was_evicted(reader) for reader, _ in silent)))
        assert evicted >= MAX_CONNECTIONS  # the oldest made room for later ones, and for alice
    finally:
        for _, writer in silent:
            writer.close()


async def test_one_users_blocking_reads_are_bounded_and_others_are_served(small_pool: Pool) -> None:
    async with small_pool.client("bob") as bob, small_pool.client("alice") as alice:
        job_id = (await bob.call(Enqueue({"argv": ["sleep", "60"]}, None), Enqueued)).job_id
        follows = [
            asyncio.create_task(bob.call(FollowLogs(job_id, True, ""), LogEnd))
            for _ in range(MAX_BLOCKING_PER_USER)
        ]
        await asyncio.sleep(0.5)  # all of them blocking now
        with pytest.raises(ClientError) as err:
            await bob.call(FollowLogs(job_id, True, ""), LogEnd)
        assert err.value.code == ErrorCode.UNAVAILABLE
        assert f"already has {MAX_BLOCKING_PER_USER}" in err.value.message
        mine = (await alice.call(Enqueue({"argv": ["true"]}, None), Enqueued)).job_id
        await alice.call(CancelJobs([mine]), Cancelled)
        assert isinstance(await alice.call(FollowLogs(mine, True, ""), LogEnd), LogEnd)  # alice is served
        for task in follows:
            task.cancel()
        await asyncio.gather(*follows, return_exceptions=True)
        await bob.call(CancelJobs([job_id]), Cancelled)


async def test_a_request_with_too_many_ids_is_refused_at_once(small_pool: Pool) -> None:
    async with small_pool.client("alice") as alice:
        started = time.monotonic()
        with pytest.raises(ClientError) as err:
            await alice.call(CancelJobs([f"default.{i:012d}" for i in range(MAX_IDS + 1)]), Cancelled)
        assert err.value.code == ErrorCode.INVALID_ARGUMENT
        assert f"at most {MAX_IDS}" in err.value.message
        assert time.monotonic() - started < 30  # a bound on the test, not a speed assertion


async def test_one_host_holds_at_most_a_few_connections_that_do_not_authenticate(small_pool: Pool) -> None:
    host, port = small_pool.address.rsplit(":", 1)
    per_host = Limits().max_unauthenticated_per_host
    silent = [await asyncio.open_connection(host, int(port)) for _ in range(per_host + 4)]
    other = await asyncio.open_connection(host, int(port), local_addr=("127.0.0.2", 0))  # another host
    try:

        async def said(reader: asyncio.StreamReader) -> bytes:
            with contextlib.suppress(TimeoutError, ConnectionError):
                return await asyncio.wait_for(reader.read(), 1)
            return b""

        told = await asyncio.gather(*(said(reader) for reader, _ in silent))
        assert [b"from 127.0.0.1 are authenticating" in t for t in told] == [True] * 4 + [False] * per_host
        assert await said(other[0]) == b""  # still open: its host is within its bound
    finally:
        for _, writer in [*silent, other]:
            writer.close()


async def test_one_user_holds_at_most_so_many_connections_and_others_are_served(small_pool: Pool) -> None:
    bobs = [small_pool.client("bob") for _ in range(PER_USER)]
    try:
        for c in bobs:
            await c.connect()
        with pytest.raises(ClientError) as err:
            async with small_pool.client("bob") as extra:
                await extra.call(Ping(), Pong)
        assert err.value.code == ErrorCode.UNAVAILABLE
        assert f"bob has {PER_USER} connections open" in err.value.message
        async with small_pool.client("alice") as alice:  # everyone else is served
            assert isinstance(await alice.call(Ping(), Pong), Pong)
    finally:
        for c in bobs:
            await c.close()
    async with small_pool.client("bob") as bob:  # closed ones give their places back
        assert isinstance(await bob.call(Ping(), Pong), Pong)


async def test_all_users_blocking_reads_together_are_bounded(
    small_pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("daemon.server.handlers.MAX_BLOCKING", 3)
    async with small_pool.client("bob") as bob, small_pool.client("alice") as alice:
        job_id = (await bob.call(Enqueue({"argv": ["sleep", "60"]}, None), Enqueued)).job_id
        follows = [asyncio.create_task(bob.call(FollowLogs(job_id, True, ""), LogEnd)) for _ in range(3)]
        await asyncio.sleep(0.5)  # all of them blocking now
        hers = (await alice.call(Enqueue({"argv": ["sleep", "60"]}, None), Enqueued)).job_id
        with pytest.raises(ClientError) as err:
            await alice.call(FollowLogs(hers, True, ""), LogEnd)
        assert err.value.code == ErrorCode.UNAVAILABLE
        assert "retry in a moment" in err.value.message
        for follow in follows:
            follow.cancel()
        await asyncio.gather(*follows, return_exceptions=True)


async def test_a_huge_request_is_decoded_while_others_are_served(small_pool: Pool) -> None:
    """Decoding a maximal frame of ids takes the server a second or more of Python: it happens off
    its event loop, so bob is answered while alice's request is still being decoded. The frame's
    last byte is held back until the server has the rest, then bob's ping follows it at once."""
    async with small_pool.client("alice") as alice, small_pool.client("bob") as bob:
        write, held = hold_back_last_byte(alice)
        answered: list[str] = []

        async def cancel(ids: list[str]) -> Cancelled:
            try:
                return await alice.call(CancelJobs(ids), Cancelled)
            finally:
                answered.append("alice")

        huge = asyncio.create_task(cancel([f"{i:07d}" for i in range(1_500_000)]))
        for _ in range(200):
            if held:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the server has all of it but one byte
        write(held[0])
        assert isinstance(await bob.call(Ping(), Pong), Pong)
        answered.append("bob")
        with pytest.raises(ClientError) as err:
            await huge
        assert f"at most {MAX_IDS}" in err.value.message  # refused, once decoded
        assert answered == ["bob", "alice"]


def hold_back_last_byte(client: PoolClient) -> tuple[Callable[[bytes], None], list[bytes]]:
    """From now on `client` sends every write over 1 MiB but its last byte, kept in the list:
    the server holds a partly received frame until the test writes it (with the function)."""
    assert client._writer is not None
    write, held = client._writer.write, []

    def hold(data: bytes | bytearray | memoryview) -> None:
        if len(data) > 1 << 20:
            write(data[:-1])
            held.append(bytes(data[-1:]))
        else:
            write(data)

    client._writer.write = hold  # type: ignore[method-assign]
    return write, held


async def test_one_user_cannot_hold_every_byte_of_the_partial_frame_budget(small_pool: Pool) -> None:
    """The bytes of partly received frames are bounded across connections, and one user's share
    of them to half: alice trickling frames she never finishes cannot stop bob sending his."""
    assert small_pool.server.listener is not None
    small_pool.server.listener._budget = FrameBudget(4 * MiB)
    big = CancelJobs([f"default.{i:012d}" for i in range(75_000)])  # ~1.6 MB, refused once read
    async with (
        small_pool.client("alice") as first,
        small_pool.client("alice") as second,
        small_pool.client("bob") as bob,
    ):
        calls = []
        for alice in (first, second):
            hold_back_last_byte(alice)
            calls.append(asyncio.create_task(alice.call(big, Cancelled)))
            await asyncio.sleep(0.5)  # all of it but a byte is with the server
        with pytest.raises(ClientError):  # her second frame took her past half the budget
            await asyncio.wait_for(calls[1], 10)
        with pytest.raises(ClientError) as err:
            await asyncio.wait_for(bob.call(big, Cancelled), 10)
        assert f"at most {MAX_IDS}" in err.value.message  # bob's was read, whole, and answered
        calls[0].cancel()
        await asyncio.gather(calls[0], return_exceptions=True)


async def test_a_client_closed_under_a_request_fails_it_with_a_client_error(small_pool: Pool) -> None:
    async with small_pool.client("alice") as alice:
        job_id = (await alice.call(Enqueue({"argv": ["sleep", "60"]}, None), Enqueued)).job_id
        follow = asyncio.create_task(alice.call(FollowLogs(job_id, True, ""), LogEnd))
        await asyncio.sleep(0.3)
        await alice.close()
        with pytest.raises(ClientError):
            await asyncio.wait_for(follow, 10)
    async with small_pool.client("alice") as alice:
        await alice.call(CancelJobs([job_id]), Cancelled)


# -- what one user may put in the pool (issue 44 item 6) -------------------------------------------


async def test_a_job_name_or_spec_over_its_bound_is_refused_saying_which_option(pool: Pool) -> None:
    """issue 44 item 6: a job's name and its whole spec are bounded (job_name_max_chars,
    job_spec_max_bytes); a refusal says the bound and the option, and nothing is queued."""
    async with pool.client("alice") as alice:
        with pytest.raises(ClientError) as err:
            await alice.call(Enqueue({"argv": ["true"], "name": "n" * 257}, None), Enqueued)
        assert err.value.code == ErrorCode.INVALID_ARGUMENT
        assert "257 characters, more than the 256" in err.value.message
        assert "job_name_max_chars" in err.value.message
        big_env = {f"V{i}": "x" * 1000 for i in range(70)}
        with pytest.raises(ClientError) as err:
            await alice.call(EnqueueBatch([{"argv": ["true"], "env": big_env}]), EnqueuedBatch)
        assert err.value.code == ErrorCode.INVALID_ARGUMENT
        assert "more than the 65536 this pool takes (job_spec_max_bytes" in err.value.message
        assert (await alice.call(ListJobs(None, None, True, 100), JobList)).jobs == []


async def test_a_users_queued_jobs_are_bounded_even_when_sent_at_once_and_others_are_served(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 44 item 6: a user's jobs queued or running in a queue are bounded
    (user_max_queued_jobs), checked in the script that adds them, so requests sent together
    cannot pass the bound together; a batch over it is refused whole; others are served, and
    the user's ended jobs make room again."""
    async with (
        running_pool(redis_server, tmp_path, user_max_queued_jobs=3) as pool,
        pool.client("alice") as alice,
        pool.client("bob") as bob,
    ):
        sent = [alice.call(Enqueue({"argv": ["sleep", "60"]}, None), Enqueued) for _ in range(8)]
        answers = await asyncio.gather(*sent, return_exceptions=True)
        queued = [a.job_id for a in answers if isinstance(a, Enqueued)]
        refused = [a for a in answers if isinstance(a, ClientError)]
        assert (len(queued), len(refused)) == (3, 5)
        assert refused[0].code == ErrorCode.RESOURCE_EXHAUSTED
        assert "alice has 3 jobs queued or running in queue 'default'" in refused[0].message
        assert "user_max_queued_jobs" in refused[0].message
        await alice.call(CancelJobs(queued[:1]), Cancelled)
        with pytest.raises(ClientError, match="2 more would pass the 3"):
            await alice.call(EnqueueBatch([{"argv": ["true"]}] * 2), EnqueuedBatch)
        listed = await alice.call(ListJobs(None, "queued", False, 100), JobList)
        assert len(listed.jobs) == 2  # the batch refused whole
        assert isinstance(await alice.call(Enqueue({"argv": ["true"]}, None), Enqueued), Enqueued)
        assert isinstance(await bob.call(Enqueue({"argv": ["true"]}, None), Enqueued), Enqueued)


async def test_enqueue_then_cancel_is_bounded_in_bytes_over_every_queue(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 44 item 6: a cancelled job's record stays for the retention, so a user could fill
    Redis by enqueueing 60 KB specs and cancelling them, counted nowhere. The server refuses
    them past user_max_stored_bytes, over every queue, saying so; another user is served."""
    async with (
        running_pool(redis_server, tmp_path, user_max_stored_bytes=2**20) as pool,
        pool.client("alice") as alice,
        pool.client("bob") as bob,
    ):
        big = {"argv": ["echo", "x" * 60_000]}
        taken = 0
        for n in range(40):
            try:
                job_id = (await alice.call(Enqueue({**big, "queue": f"q{n % 3}"}, None), Enqueued)).job_id
            except ClientError as exc:
                refused = exc
                break
            await alice.call(CancelJobs([job_id]), Cancelled)
            taken += 1
        assert taken == 15  # of 66 KB within 1 MiB
        assert refused.code == ErrorCode.RESOURCE_EXHAUSTED
        assert "user_max_stored_bytes" in refused.message
        assert "room comes back" in refused.message
        assert isinstance(await bob.call(Enqueue(big, None), Enqueued), Enqueued)


async def test_submissions_are_refused_before_redis_is_full_while_cancels_and_reads_go_on(
    pool: Pool, redis_server: EmbeddedRedis
) -> None:
    """issue 44 item 6: from 90% of the Redis's maxmemory the server takes no new job, saying
    so, while a cancel and a listing still work (they are how memory comes back)."""
    async with pool.client("alice") as alice:
        job_id = (await alice.call(Enqueue({"argv": ["sleep", "60"]}, None), Enqueued)).job_id
        async with redis_server.client() as admin:
            used = int((await admin.info("memory"))["used_memory"])
            await admin.set("filler", b"x" * (37 * MiB // 2 - used))
            await admin.config_set("maxmemory", 20 * MiB)  # filled to over 90% of it: not yet full
            try:
                await asyncio.sleep(1.1)  # the server reads Redis's memory at most once a second
                with pytest.raises(ClientError) as err:
                    await alice.call(Enqueue({"argv": ["true"]}, None), Enqueued)
                assert err.value.code == ErrorCode.RESOURCE_EXHAUSTED
                assert "the pool's Redis is full, or nearly (" in err.value.message
                assert "MiB of its 20.0 MiB maxmemory in use" in err.value.message
                assert "redis_max_memory" in err.value.message
                assert len((await alice.call(ListJobs(None, None, True, 100), JobList)).jobs) == 1
                assert (await alice.call(CancelJobs([job_id]), Cancelled)).states == {job_id: "cancelled"}
            finally:
                await admin.config_set("maxmemory", 0)
                await admin.delete("filler")


async def test_a_listing_cut_at_its_bytes_says_how_many_more_there_are(pool: Pool) -> None:
    """issue 44 item 6: a listing that stopped at its bytes (8 MiB of records, whatever the row
    count asked for) left the rest out silently. Its last record says how many more there were,
    and `poolctl ls` prints it with how to narrow the listing."""
    fat = JobSpec(
        argv=("true", *("a" * 300 for _ in range(40))),
        env={f"V{i}_{'x' * 300}": "y" * 300 for i in range(40)},
        user="alice",
    )
    await pool.queue.enqueue_many([fat] * 400)  # ~24 KiB each as listed: ~340 fit
    code, out, err = await poolctl(pool.env("alice"), "ls", "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert 300 < len(rows) < 400
    assert rows[-1][MORE] == 400 - len(rows)
    assert f"poolctl: {400 - len(rows)} more not shown" in err
    assert "--me, --name, --queue, --state or --limit" in err


async def test_one_users_long_fields_cannot_break_listing_for_others(pool: Pool) -> None:
    """issue 44 item 6: jobs with names of 100 KiB (stored before the bounds: written through the
    queue itself) made `poolctl ls --all` fail for every user, its reply over the frame limit,
    and the dashboard's job list tens of MiB. Listings cut each field (with an ellipsis) and stay
    within their bytes: bob lists everything, and his own job is there."""
    long_name = "n" * 100 * 1024
    await pool.queue.enqueue_many(
        [JobSpec(argv=("true", "a" * 1024), name=long_name, user="alice") for _ in range(200)]
    )
    async with pool.client("bob") as bob:
        mine = (await bob.call(Enqueue({"argv": ["true"], "name": "bobs"}, None), Enqueued)).job_id
    code, out, err = await poolctl(pool.env("bob"), "ls", "--all", "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 201
    assert rows[-1]["id"] == mine
    assert rows[0]["spec"]["name"] == "n" * (FIELD_CHARS - 1) + "…"
    assert rows[0]["shortened"]
    assert len(out) < 1_000_000
    async with (
        aiohttp.ClientSession(
            cookie_jar=aiohttp.CookieJar(unsafe=True), timeout=aiohttp.ClientTimeout(total=30)
        ) as http,
    ):
        assert pool.server.web is not None
        url = pool.server.web.address
        async with http.post(f"{url}/signin", data={"token": pool.tokens["bob"]}, allow_redirects=False) as r:
            assert r.status == 303
        async with http.get(f"{url}/jobs?sort=enqueued&order=asc") as r:
            assert r.status == 200
            page = await r.text()
    assert "n" * (FIELD_CHARS - 1) + "…" in page
    assert long_name not in page
    assert len(page) < 500_000


async def test_a_users_channels_have_a_bound_of_their_own_beside_their_blocking_reads(
    small_pool: Pool,
) -> None:
    """Issue 49: a JupyterLab in a browser holds some 14 connections through `poolctl forward` (six
    keep-alive HTTP ones, its events' and each kernel's websocket), each a channel; channels held
    the user's 16 blocking reads with `logs -f` and `wait`, so a forward relayed 8 at most and a
    second notebook's kernel never answered. Channels have MAX_CHANNELS_PER_USER of their own (and
    count among the server's MAX_BLOCKING), whatever the user's blocking reads hold."""

    async def nothing(stream: str, data: bytes) -> None:
        del stream, data

    async def no_input() -> AsyncIterator[bytes]:
        await asyncio.Event().wait()
        yield b""

    def forward(client: PoolClient, job_id: str) -> Coroutine[Any, Any, ChannelClosed]:
        return client.channel(OpenChannel(job_id, "forward", [], True, port=9), nothing, no_input())

    async with small_pool.client("bob") as bob, small_pool.client("bob") as more:
        job_id = (await bob.call(Enqueue({"argv": ["sleep", "60"]}, None), Enqueued)).job_id
        assert await small_pool.queue.claim("stand-in", ["default"]) is not None  # running
        held: list[asyncio.Task[Any]] = [
            asyncio.create_task(bob.call(FollowLogs(job_id, True, ""), LogEnd))
            for _ in range(MAX_BLOCKING_PER_USER)
        ]
        held += [asyncio.create_task(forward(more, job_id)) for _ in range(MAX_CHANNELS_PER_USER)]
        try:
            await asyncio.sleep(1.0)  # all of them open (no worker answers the channels for 10 s)
            refused = [t for t in held if t.done()]
            assert not refused, refused[0].exception()
            with pytest.raises(ClientError) as err:
                await forward(bob, job_id)
            assert err.value.code == ErrorCode.UNAVAILABLE
            assert f"already has {MAX_CHANNELS_PER_USER} channels" in err.value.message
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
