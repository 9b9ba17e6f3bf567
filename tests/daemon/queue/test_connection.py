"""connection.py: the one client factory. Its commands are packed by hiredis, byte for byte as
redis-py's own packer would, refusing what it refuses; and a real Redis reads them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.connection import Connection
from redis.exceptions import DataError
from redis.typing import EncodableT

from daemon.queue.connection import PackedConnection
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
        assert redis.connection_pool.connection_class is PackedConnection
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
