"""connection.py: the one client factory. Its commands are packed by hiredis, byte for byte as
redis-py's own packer would, refusing what it refuses; and a real Redis reads them."""

from __future__ import annotations

import os
import signal
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.connection import Connection
from redis.exceptions import DataError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT

from daemon.queue.connection import PackedConnection, PackedUnixConnection, connect
from daemon.queue.embedded_redis import EmbeddedRedis

ARGUMENTS: st.SearchStrategy[EncodableT] = st.one_of(
    st.binary(max_size=64),
    st.binary(max_size=8).map(bytearray),
    st.text(max_size=32),
    st.integers(),
    st.floats(allow_nan=False),
)


@given(
    st.sampled_from(["SET", "EVALSHA", b"HSET", "CONFIG GET", b"XINFO GROUPS"]),
    st.lists(ARGUMENTS, max_size=12),
)
def test_commands_are_packed_as_redis_py_packs_them(command: str | bytes, args: list[EncodableT]) -> None:
    ours, theirs = PackedConnection(), Connection()
    assert b"".join(ours.pack_command(command, *args)) == b"".join(theirs.pack_command(command, *args))
    assert b"".join(ours.pack_commands([(command, *args)] * 2)) == b"".join(
        theirs.pack_commands([(command, *args)] * 2)
    )


@pytest.mark.parametrize("bad", [None, True, [1], {"a": 1}])
def test_what_redis_py_refuses_is_refused_the_same_way(bad: object) -> None:
    with pytest.raises(DataError, match="Invalid input of type"):
        Connection().pack_command("SET", "k", bad)  # type: ignore[arg-type]
    with pytest.raises(DataError, match="Invalid input of type"):
        PackedConnection().pack_command("SET", "k", bad)  # type: ignore[arg-type]


async def test_every_client_speaks_through_it(redis_server: EmbeddedRedis) -> None:
    redis = redis_server.client()
    try:
        assert redis.connection_pool.connection_class is PackedUnixConnection  # (its Unix socket)
        big = b"\x00\xff" * 100_000  # past redis-py's own chunking threshold
        await redis.set("k", big)
        assert await redis.get("k") == big
        async with redis.pipeline(transaction=False) as pipe:
            pipe.set("a", 1.5)
            pipe.incrbyfloat("a", -0.5)
            pipe.get("a")
            assert await pipe.execute() == [True, 1.0, b"1"]
    finally:
        await redis.aclose()


async def test_a_write_redis_does_not_take_times_out_and_drops_the_connection(
    redis_server: EmbeddedRedis,
) -> None:
    """A write is bounded by the socket timeout, as redis-py bounds it (PackedConnection does it
    without a task of its own): a frozen Redis whose socket buffers are full fails the write
    with redis-py's TimeoutError, the connection dropped, and a later command goes through."""
    redis = connect("127.0.0.1", redis_server.port, password=redis_server.password, socket_timeout=0.5)
    assert redis_server.pid is not None
    try:
        await redis.ping()
        os.kill(redis_server.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(RedisTimeoutError):
                await redis.set("huge", b"x" * 64 * 2**20)  # more than any socket buffer holds
            assert time.monotonic() - started < 5  # its timeout for each of the client's few tries
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
        assert await redis.ping()
    finally:
        await redis.aclose()
