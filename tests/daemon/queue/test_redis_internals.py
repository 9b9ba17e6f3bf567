"""issue 46: the fast path's transport (daemon/queue/fast_path.py `FastTransport`, `Lane`) writes
and reads on redis-py's connections itself, below redis-py's public API. pyproject.toml bounds
redis-py to the major these tests pass on; these tests fail, naming the internal, when one it
relies on moves or changes shape, and check that its replies are those of plain redis-py."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError

from daemon.queue.fast_path import FastTransport, Lane
from daemon.queue.scripts import PLAIN


def _attribute(path: str) -> Any:
    """The object at dotted `path` ('redis.asyncio.connection.AbstractConnection.read_response')."""
    module_name, _, rest = path.partition(":")
    obj: Any = __import__(module_name, fromlist=["_"])
    for name in rest.split("."):
        if not hasattr(obj, name):
            pytest.fail(f"redis-py's {path.replace(':', '.')} is gone: the fast path's transport calls it")
        obj = getattr(obj, name)
    return obj


# What the fast path's transport uses of redis-py, and how: (where, is it a coroutine, parameters
# it passes by name).
INTERNALS: list[tuple[str, bool, tuple[str, ...]]] = [
    ("redis.asyncio.connection:AbstractConnection.send_packed_command", True, ()),
    ("redis.asyncio.connection:AbstractConnection.pack_commands", False, ()),
    ("redis.asyncio.connection:AbstractConnection.read_response", True, ("timeout",)),
    ("redis.asyncio.connection:AbstractConnection.disconnect", True, ("nowait",)),
    ("redis.asyncio.connection:ConnectionPool.get_connection", True, ()),
    ("redis.asyncio.connection:ConnectionPool.release", True, ()),
    ("redis.asyncio.cluster:ClusterNode.acquire_connection", False, ()),
    ("redis.asyncio.cluster:ClusterNode.release", False, ()),
    ("redis.asyncio.retry:Retry.call_with_retry", True, ()),
]


@pytest.mark.parametrize(("path", "coroutine", "named"), INTERNALS, ids=[p for p, *_ in INTERNALS])
def test_every_redis_py_internal_the_fast_transport_calls_is_where_and_as_it_expects(
    path: str, coroutine: bool, named: tuple[str, ...]
) -> None:
    """issue 46: each redis-py internal the fast path's transport calls still exists, is still a
    coroutine function (or still not one), and still takes the arguments it passes by name."""
    function: Callable[..., Any] = _attribute(path)
    where = path.replace(":", ".")
    kind = "a coroutine function" if coroutine else "a plain function"
    assert inspect.iscoroutinefunction(function) is coroutine, (
        f"redis-py's {where} is no longer {kind}: the fast path's transport (queue/fast_path.py) "
        "awaits it as one; fix the transport, or run with fast_path = false"
    )
    parameters = inspect.signature(function).parameters
    for name in named:
        assert name in parameters, (
            f"redis-py's {where} no longer takes `{name}`: the fast path's transport "
            "(queue/fast_path.py) passes it; fix the transport, or run with fast_path = false"
        )


async def test_a_connection_still_has_the_attributes_the_fast_transport_reads(redis: Redis) -> None:
    """issue 46: the fast path reads a connection's `socket_timeout` (its one timer over a batch's
    replies) and `retry` (a batch sent again on a broken connection), and documents
    `read_response(timeout=math.inf)` as a read with no timer of its own."""
    connection = await redis.connection_pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        for name in ("socket_timeout", "retry"):
            assert hasattr(connection, name), (
                f"redis-py's connections no longer have `{name}`: the fast path's transport "
                "(queue/fast_path.py `_exchange`) reads it"
            )
        doc = inspect.getdoc(type(connection).read_response) or ""
        assert "math.inf" in doc, (
            "redis-py's AbstractConnection.read_response no longer documents timeout=math.inf as "
            "a read with no timeout: the fast path's `_exchange` reads every reply so, under one timer"
        )
    finally:
        await redis.connection_pool.release(connection)


def _shape(replies: list[Any]) -> list[Any]:
    """Replies as comparable values: an error reply as its class and message."""
    return [(type(r).__name__, str(r)) if isinstance(r, Exception) else r for r in replies]


async def test_the_fast_transport_answers_as_plain_redis_py_does(redis: Redis) -> None:
    """issue 46: the commands a batch sends on one Redis (EVALSHA, a plain Command such as SADD,
    the PUBLISH and WAIT of a durable batch), a script never loaded (NOSCRIPT) and a script's
    error reply among them, get the same replies, in the same places, through plain redis-py's
    pipeline (which passes replies through its response callbacks: none of these has one), the
    fast path's hand-rolled exchange, and that exchange on a kept connection."""
    echo = await redis.script_load("return ARGV[1]")
    refuse = await redis.script_load("return redis.error_reply('refused here')")

    def commands(tag: str) -> list[tuple[Any, ...]]:
        return [
            ("EVALSHA", echo, 1, f"k:{tag}", "answer"),
            ("EVALSHA", "0" * 40, 1, f"k:{tag}"),
            ("SADD", f"k:{tag}", "q"),
            ("EVALSHA", refuse, 1, f"k:{tag}"),
            ("PUBLISH", "nobody", "x"),
            ("WAIT", 0, 0),
            ("SREM", f"k:{tag}", "q"),
        ]

    plain = await PLAIN.exchange(redis, commands("a"))
    assert plain[0] == b"answer"
    assert isinstance(plain[1], NoScriptError)
    assert isinstance(plain[3], ResponseError)
    lane = FastTransport(Lane())
    for fast in (FastTransport(None), lane, lane):  # the lane's kept connection, used twice
        assert _shape(await fast.exchange(redis, commands("a"))) == _shape(plain)
