"""A worker's blocking read for work, whose answer waits in its socket until the worker asks.

One XREAD BLOCK (JobQueue.read_for_work), on a connection of its own from the client's pool:
sent once, then `answer()` awaits its reply, and may be cancelled any number of times without
losing the reply or the connection (redis-py drops a connection whose read was cancelled). So
nobody reads it between a worker's waits, and a reply that comes then stays in the socket until
the next wait: a job enqueued with an idle worker's standing claim (fast_path.Standing) wakes this
read too, Redis answers the read first, and the job's start no longer waits behind its parsing.

On a Redis Cluster a read may span several slots (`reads.xread`): there it runs as a task of its
own, kept from one wait to the next, as every read did before.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT

from daemon.aio import cancel_and_wait
from daemon.queue.connection import AnyRedis, ReplyReader, block_limit, connection_options
from daemon.queue.reads import _s, xread

Woken = list[tuple[str, str]]  # (stream, entry id) of each entry that ended the read


class WorkRead:
    """XREAD BLOCK on `streams` ({name: id to read after}) for up to `block` seconds (at most
    `block_limit`). `answer()` until it has one; `close()` at the end, answered or not."""

    def __init__(self, redis: AnyRedis, streams: dict[str, str], block: float) -> None:
        self.redis = redis
        self.streams = streams
        self.block = min(block, block_limit(redis))
        self._woken: Woken | None = None
        self._connection: AbstractConnection | None = None  # from the pool while it is read
        self._reader = ReplyReader()
        self._deadline = 0.0
        self._task: asyncio.Future[Woken] | None = None  # on a Cluster
        self._pool = None if isinstance(redis, RedisCluster) else redis.connection_pool

    @property
    def woken(self) -> Woken | None:
        """The answer, once `answer()` has had it; else None."""
        return self._woken

    async def answer(self) -> Woken:
        """The entries that ended the read ([]: `block` passed). Cancelling the wait for it
        changes nothing: the next call goes on waiting. Raises RedisError when Redis failed (the
        read is over then)."""
        if self._woken is not None:
            return self._woken
        if self._pool is None:  # a Cluster
            if self._task is None:
                self._task = asyncio.ensure_future(self._cluster_read())
            self._woken = await asyncio.shield(self._task)
            return self._woken
        if self._connection is None:
            await self._send()
        assert self._connection is not None
        try:
            async with asyncio.timeout_at(self._deadline):
                reply = await self._reader.read(self._connection)
        except asyncio.CancelledError:
            raise  # the reply, when it comes, waits for the next call
        except BaseException as exc:
            await self._drop()
            if isinstance(exc, TimeoutError):
                raise RedisTimeoutError("Timeout reading a blocking XREAD's reply") from None
            raise
        self._woken = _woken(reply)
        return self._woken

    async def close(self) -> None:
        """End the read: its connection goes back to the pool, dropped first when the reply is
        still to come."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            if not self._task.cancelled():
                self._task.exception()  # retrieved: it has ended either way
        if self._woken is not None:
            await self._release()
        elif self._connection is not None:
            await self._drop()

    async def _send(self) -> None:
        assert self._pool is not None
        connection: AbstractConnection = await self._pool.get_connection()  # type: ignore[no-untyped-call]
        self._connection = connection
        ms = max(1, round(self.block * 1000))
        command: list[EncodableT] = ["XREAD", "COUNT", 1, "BLOCK", ms, "STREAMS"]
        command += [*self.streams, *self.streams.values()]
        try:
            await connection.send_packed_command(connection.pack_command(*command))
        except BaseException:
            await self._drop()
            raise
        timeout = connection_options(self.redis).get("socket_timeout") or 0.0
        self._deadline = asyncio.get_running_loop().time() + self.block + float(timeout)

    async def _release(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and self._pool is not None:
            await self._pool.release(connection)

    async def _drop(self) -> None:
        """Disconnect, then release: a connection with a reply to come is of no use to anyone."""
        if self._connection is not None:
            await self._connection.disconnect()
        await self._release()

    async def _cluster_read(self) -> Woken:
        read = await xread(self.redis, self.streams, count=1, block=self.block)
        return [(stream, _s(entry_id)) for stream, entries in read for entry_id, _ in entries]


def _woken(reply: Any) -> Woken:
    """XREAD's reply ([[stream, [[id, fields], ...]], ...], or nil on timeout) as (stream, entry
    id) pairs."""
    if isinstance(reply, RedisError):
        raise reply
    if reply is None:
        return []
    if isinstance(reply, dict):  # RESP3
        reply = list(reply.items())
    if not isinstance(reply, list):
        raise ConnectionError(f"a blocking XREAD was answered {type(reply).__name__}")
    return [(_s(stream), _s(entry[0])) for stream, entries in reply for entry in entries]
