"""scripts.py: script calls batched into one round trip, and what each caller gets back."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from daemon.queue.connection import RETRIES, connect
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.fast_path import MAX_BATCH, Pipeliner
from daemon.queue.scripts import Command


def counting_round_trips(redis: Redis) -> list[int]:
    """Patch `redis` so each round trip it makes is counted: each writes its commands at once (a
    command, a pipeline, a batch of script calls alike), on any connection of its pool, a
    Pipeliner's kept one (fast_path.Lane) included."""
    made: list[int] = []
    pool = redis.connection_pool

    def counting(connection: AbstractConnection) -> AbstractConnection:
        send, connect = connection.send_packed_command, connection.connect
        quiet = False  # while it connects (its handshake), or while one write goes out

        async def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal quiet
            if quiet:
                return await send(*args, **kwargs)
            made.append(1)
            quiet = True
            try:
                return await send(*args, **kwargs)
            finally:
                quiet = False

        async def connecting() -> None:
            nonlocal quiet
            was, quiet = quiet, True
            try:
                await connect()  # type: ignore[no-untyped-call]
            finally:
                quiet = was

        connection.send_packed_command = counted  # type: ignore[method-assign]
        connection.connect = connecting  # type: ignore[method-assign]
        return connection

    for connection in [*pool._available_connections, *pool._in_use_connections]:
        counting(connection)
    make_connection = pool.make_connection
    pool.make_connection = lambda: counting(make_connection())  # type: ignore[method-assign,no-untyped-call]
    return made


async def test_calls_made_in_one_turn_share_round_trips_and_each_gets_its_answer(redis: Redis) -> None:
    call = Pipeliner(redis)
    echo = redis.register_script("redis.call('RPUSH', KEYS[1], ARGV[1]); return ARGV[1]")
    await redis.script_load(echo.script)  # else a NOSCRIPT answer adds a round trip to load it
    made = counting_round_trips(redis)
    n = MAX_BATCH * 2 + 5  # three pipelines: two full ones, then the rest
    replies = await asyncio.gather(*(call(echo, ["order"], [str(i)]) for i in range(n)))
    assert replies == [str(i).encode() for i in range(n)]
    assert len(made) == 3
    done = await redis.lrange("order", 0, -1)
    # each pipeline runs in order; the pipelines of one turn run side by side, as concurrent
    # callers' calls do anyway
    assert [x for x in done if int(x) < MAX_BATCH] == [str(i).encode() for i in range(MAX_BATCH)]
    assert sorted(done, key=int) == [str(i).encode() for i in range(n)]
    assert await call(echo, ["order"], ["later"]) == b"later"  # a call alone goes at once, as is
    assert len(made) == 5  # and the read of the list


async def test_a_call_ahead_travels_alone_and_the_calls_made_with_it_follow_its_answer(
    redis: Redis,
) -> None:
    """A claim goes ahead (`submit(ahead=True)`): Redis answers a batch once it has run all of it,
    so batched with the outcome of the job whose slot it fills, its reply would wait for that
    script. It goes alone, first; the calls made with it, and while it is in flight, after."""
    call = Pipeliner(redis)
    echo = redis.register_script("redis.call('RPUSH', KEYS[1], ARGV[1]); return ARGV[1]")
    await redis.script_load(echo.script)
    made = counting_round_trips(redis)
    before = call(echo, ["order"], ["outcome"])  # made first, in the same turn
    claim = call(echo, ["order"], ["claim"], ahead=True)
    after = call(echo, ["order"], ["log"])
    assert list(await asyncio.gather(before, claim, after)) == [b"outcome", b"claim", b"log"]
    assert len(made) == 2  # the claim alone, then the other two together
    assert await redis.lrange("order", 0, -1) == [b"claim", b"outcome", b"log"]


async def test_a_call_answered_first_travels_in_its_batch_and_its_caller_goes_on_a_turn_earlier(
    redis: Redis,
) -> None:
    """A standing claim rides its enqueue's batch, after it (`submit(first=True)`): it runs in
    that order, one round trip, and its caller goes on (to start the job) a turn before the
    enqueue's does (to reply to its client)."""
    call = Pipeliner(redis)
    echo = redis.register_script("redis.call('RPUSH', KEYS[1], ARGV[1]); return ARGV[1]")
    await redis.script_load(echo.script)
    made = counting_round_trips(redis)
    resumed: list[str] = []

    async def caller(name: str, reply: asyncio.Future[Any]) -> None:
        await reply
        resumed.append(name)

    enqueue = asyncio.ensure_future(caller("enqueue", call.submit(echo, ["order"], ["enqueue"])))
    claim = asyncio.ensure_future(caller("claim", call.submit(echo, ["order"], ["claim"], first=True)))
    await asyncio.gather(enqueue, claim)
    assert len(made) == 1
    assert await redis.lrange("order", 0, -1) == [b"enqueue", b"claim"]
    assert resumed == ["claim", "enqueue"]


async def test_a_call_made_ahead_while_a_sender_is_between_its_batches_is_sent(redis: Redis) -> None:
    """The next claim may be made as soon as the last one is answered, while its sender is yet to
    send the calls that followed it: that sender must look again, or the claim waits for ever."""
    call = Pipeliner(redis)
    echo = redis.register_script("return ARGV[1]")
    await redis.script_load(echo.script)
    first = call.submit(echo, [], ["claim 1"], ahead=True)
    outcome = call.submit(echo, [], ["outcome"])
    assert await first == b"claim 1"  # its sender has the outcome still to send
    second = call.submit(echo, [], ["claim 2"], ahead=True)
    assert await asyncio.wait_for(second, 5) == b"claim 2"
    assert await outcome == b"outcome"


async def test_claims_made_one_after_another_keep_one_sender_not_one_each(redis: Redis) -> None:
    """Found measuring issue 46: each claim made as the last one was answered started a sender of
    its own, and the senders before it stayed, each waiting for the next claim's answer to wake,
    look and wait again: after N claims N senders woke at every answer (the claim drain's client
    spent ~750 callbacks a claim). A sender with nothing to send after a claim in flight ends."""
    call = Pipeliner(redis)
    echo = redis.register_script("return ARGV[1]")
    await redis.script_load(echo.script)
    most = 0
    for i in range(100):
        assert await call(echo, [], [str(i)], ahead=True) == str(i).encode()
        most = max(most, len(call._in_flight))
    assert most <= 2
    await asyncio.sleep(0.01)
    assert not call._in_flight  # all gone once the claims stop


async def test_calls_that_may_linger_made_in_turns_apart_share_one_round_trip(redis: Redis) -> None:
    """Outcomes of jobs that end one after another (`linger`) wait for each other: one round trip
    for all, once the first has waited its linger; a call alone waits its linger, then goes."""
    call = Pipeliner(redis)
    echo = redis.register_script("redis.call('RPUSH', KEYS[1], ARGV[1]); return ARGV[1]")
    await redis.script_load(echo.script)
    made = counting_round_trips(redis)
    loop = asyncio.get_running_loop()
    began = loop.time()
    first = call.submit(echo, ["order"], ["1"], linger=0.2)
    await asyncio.sleep(0.05)  # turns apart: as jobs that end one after another
    second = call.submit(echo, ["order"], ["2"], linger=0.2)
    await asyncio.sleep(0.05)
    assert not first.done()
    assert made == []
    assert list(await asyncio.gather(first, second)) == [b"1", b"2"]
    assert loop.time() - began >= 0.2  # the first waited its linger, no less
    assert len(made) == 1
    assert await asyncio.wait_for(call(echo, ["order"], ["3"], linger=0.05), 5) == b"3"
    assert len(made) == 2
    assert await redis.lrange("order", 0, -1) == [b"1", b"2", b"3"]


async def test_a_call_that_may_not_linger_takes_the_lingering_ones_at_once(redis: Redis) -> None:
    """A claim made while outcomes linger does not wait for their linger: all leave at once, in
    one round trip (and a claim ahead goes first, alone, as ever)."""
    call = Pipeliner(redis)
    echo = redis.register_script("redis.call('RPUSH', KEYS[1], ARGV[1]); return ARGV[1]")
    await redis.script_load(echo.script)
    made = counting_round_trips(redis)
    outcome = call.submit(echo, ["order"], ["outcome"], linger=30)
    await asyncio.sleep(0.02)
    claim = call.submit(echo, ["order"], ["claim"])
    assert list(await asyncio.wait_for(asyncio.gather(outcome, claim), 5)) == [b"outcome", b"claim"]
    assert len(made) == 1
    outcome = call.submit(echo, ["order"], ["outcome 2"], linger=30)
    await asyncio.sleep(0.02)
    ahead = call.submit(echo, ["order"], ["claim ahead"], ahead=True)
    assert list(await asyncio.wait_for(asyncio.gather(outcome, ahead), 5)) == [b"outcome 2", b"claim ahead"]
    assert len(made) == 3
    assert await redis.lrange("order", 0, -1) == [b"outcome", b"claim", b"claim ahead", b"outcome 2"]


async def test_an_error_goes_to_its_caller_alone(redis: Redis) -> None:
    call = Pipeliner(redis)
    ok = redis.register_script("return ARGV[1]")
    bad = redis.register_script("return redis.call('INCR', KEYS[1])")
    await redis.set("text", "not a number")
    results = await asyncio.gather(
        call(ok, [], ["a"]), call(bad, ["text"], []), call(ok, [], ["b"]), return_exceptions=True
    )
    assert results[0] == b"a"
    assert isinstance(results[1], ResponseError)
    assert results[2] == b"b"


async def test_scripts_flushed_from_redis_are_loaded_again(redis: Redis) -> None:
    call = Pipeliner(redis)
    one = redis.register_script("return 1")
    assert await call(one, [], []) == 1
    await redis.script_flush()  # as after a Redis restart
    assert list(await asyncio.gather(call(one, [], []), call(one, [], []))) == [1, 1]
    await redis.script_flush()
    assert await call(one, [], []) == 1  # alone


async def test_a_dead_redis_fails_every_caller_of_the_batch(redis_server: EmbeddedRedis) -> None:
    client = redis_server.client()
    call = Pipeliner(client)
    one = client.register_script("return 1")
    assert await call(one, [], []) == 1
    redis_server.stop()
    results = await asyncio.gather(*(call(one, [], []) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, RedisConnectionError) for r in results), results
    await client.aclose()


async def test_a_cancelled_caller_leaves_the_others_their_answers(redis: Redis) -> None:
    call = Pipeliner(redis)
    slow = redis.register_script("return ARGV[1]")
    first = asyncio.ensure_future(call(slow, [], ["first"]))
    second = asyncio.ensure_future(call(slow, [], ["second"]))
    await asyncio.sleep(0)  # both are in the batch
    first.cancel()
    assert await second == b"second"
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_one_callers_batches_go_out_on_one_kept_connection(redis: Redis) -> None:
    """A Pipeliner keeps a connection for its batches (fast_path.Lane): taking one from redis-py's
    pool and giving it back was the larger part of what a batch cost this process after an idle
    spell. Batches one after the other take none from the pool after the first."""
    call = Pipeliner(redis)
    echo = redis.register_script("return ARGV[1]")
    await redis.script_load(echo.script)
    pool = redis.connection_pool
    taken: list[int] = []
    get_connection = pool.get_connection

    async def counted(*args: Any, **kwargs: Any) -> Any:
        taken.append(1)
        return await get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]

    pool.get_connection = counted  # type: ignore[method-assign]
    for i in range(5):
        assert await call(echo, [], [str(i)]) == str(i).encode()
    assert len(taken) == 1


async def test_a_kept_connection_that_redis_closed_is_made_anew(
    redis: Redis, redis_server: EmbeddedRedis
) -> None:
    """Redis closed the connection between two batches: the next batch is sent again on it, made
    anew (the client's Retry; every script is safe to run twice), and gets its answer."""
    call = Pipeliner(redis)
    echo = redis.register_script("return ARGV[1]")
    assert await call(echo, [], ["before"]) == b"before"
    other = redis_server.client()
    try:
        assert await other.client_kill_filter(_type="normal", skipme=True) >= 1
    finally:
        await other.aclose()
    assert await call(echo, [], ["after"]) == b"after"


async def test_a_batch_stopped_before_its_answer_leaves_no_answer_for_the_next(redis: Redis) -> None:
    """A sender cancelled while its batch runs in Redis (the loop stopping): the reply that comes
    later must never be read as the next batch's (a stale reply taken for a claim's starts a job
    twice). The next call gets its own answer."""
    call = Pipeliner(redis)
    slow = redis.register_script(
        "local t = redis.call('TIME'); local stop = t[1] * 1e6 + t[2] + 300000 "
        "repeat t = redis.call('TIME') until t[1] * 1e6 + t[2] >= stop return ARGV[1]"
    )
    echo = redis.register_script("return ARGV[1]")
    await redis.script_load(slow.script)
    await redis.script_load(echo.script)
    assert await call(echo, [], ["warm"]) == b"warm"  # the kept connection is made
    lane = call._lane
    assert lane is not None
    kept = lane.connection
    assert kept is not None
    first = asyncio.ensure_future(call(slow, [], ["stale"]))
    await asyncio.sleep(0.1)  # its batch is in Redis
    for sender in list(call._in_flight):
        sender.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert lane.connection is not kept, "the lane kept the connection with a reply still to come"
    # closed by redis-py itself when its read is cancelled, and by the lane too: whichever does it,
    # a connection with a reply still to come must not be open for the next batch
    assert not kept.is_connected, "the connection with a reply still to come was not closed"
    assert await call(echo, [], ["fresh"]) == b"fresh"
    assert await call(echo, [], ["again"]) == b"again"


async def test_a_lane_dropped_while_its_batch_is_out_finishes_that_batch_then_connects_anew(
    redis: Redis,
) -> None:
    """A lane is dropped (a durable write was not confirmed: the primary may have moved) while
    another batch is out on it: that batch gets its answer from its one write, not a second one
    after its connection was closed under it; the batch after it comes on a new connection."""
    call = Pipeliner(redis)
    slow = redis.register_script(
        "local t = redis.call('TIME'); local stop = t[1] * 1e6 + t[2] + 300000 "
        "repeat t = redis.call('TIME') until t[1] * 1e6 + t[2] >= stop return ARGV[1]"
    )
    await redis.script_load(slow.script)
    client_id = Command("CLIENT")
    before = await call(client_id, [], ["ID"])
    writes = counting_round_trips(redis)
    first = asyncio.ensure_future(call(slow, [], ["answer"]))
    await asyncio.sleep(0.1)  # its batch is out on the lane
    assert call._lane is not None
    assert call._lane.busy
    call._lane.drop()
    assert await first == b"answer"
    assert len(writes) == 1, "the batch out on the dropped lane was sent again"
    after = await call(client_id, [], ["ID"])
    assert after != before, "the batch after the drop came on the same connection"


async def test_a_lane_dropped_while_its_batch_connects_is_still_made_anew(redis: Redis) -> None:
    """A drop that comes while a batch on the lane is taking its connection (an await) stands:
    the batch after it comes on a new connection, not on the one made before the drop."""
    call = Pipeliner(redis)
    lane = call._lane
    assert lane is not None
    pool = redis.connection_pool
    get_connection = pool.get_connection

    async def dropped_meanwhile(*args: Any, **kwargs: Any) -> Any:
        connection = await get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        lane.drop()  # the primary may have moved while this one connected
        return connection

    pool.get_connection = dropped_meanwhile  # type: ignore[method-assign]
    client_id = Command("CLIENT")
    before = await call(client_id, [], ["ID"])
    pool.get_connection = get_connection  # type: ignore[method-assign]
    after = await call(client_id, [], ["ID"])
    assert after != before, "the drop made while the lane connected was lost"


async def test_a_batch_redis_does_not_answer_times_out_and_the_next_one_is_answered(
    redis_server: EmbeddedRedis,
) -> None:
    """A batch's replies are read under one timer, the client's socket timeout (fast_path._exchange),
    not one per reply: a frozen Redis fails the batch's callers with redis-py's TimeoutError once
    each of the client's few tries has timed out (never a wait without end), and, Redis back, the
    next batch is answered on a connection made anew."""
    client = connect("127.0.0.1", redis_server.port, password=redis_server.password, socket_timeout=0.3)
    call = Pipeliner(client)
    echo = client.register_script("return ARGV[1]")
    assert await call(echo, [], ["before"]) == b"before"
    assert redis_server.pid is not None
    os.kill(redis_server.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        results = await asyncio.gather(*(call(echo, [], [str(i)]) for i in range(3)), return_exceptions=True)
        waited = time.monotonic() - started
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
    assert all(isinstance(r, RedisTimeoutError) for r in results), results
    assert waited < (RETRIES + 1) * (0.3 + 0.5) + 2  # each try its timeout, and its backoff
    assert await call(echo, [], ["after"]) == b"after"
    await client.aclose()
