"""The queue's Lua scripts, loaded from daemon/queue/lua/ with the helpers of lua/lib/ each one calls.

Each script's header comment says what it guarantees. redis-py's Script objects run by EVALSHA
and fall back to loading the script on NOSCRIPT, so they survive a Redis restart.

`ScriptBatch` sends several script calls in ONE round trip. redis-py's own pipelined scripts ask
Redis `SCRIPT EXISTS` before every pipeline, a second round trip; a batch sends EVALSHA straight
away and only on a NOSCRIPT answer (Redis restarted or flushed its script cache) loads the
missing scripts and re-sends the calls that were refused, which therefore never ran. How a batch
travels is its `Transport`: `PlainTransport`, redis-py's own pipeline (a Cluster node's
connection, as redis-py's cluster pipeline uses it), or, with the fast path on, the fast path's
(queue/fast_path.py). `PlainCalls` sends each script call by itself, as it is made: what a
JobQueue calls with while the fast path is off (its auto-pipelining `Pipeliner` otherwise).

Durable calls (enqueues, outcomes) are acknowledged only once `ReplicaAck.replicas` replicas have
them: a batch holding one ends with a WAIT, in the same round trip, which covers every write the
batch made on its connection. A durable call whose batch's WAIT counted fewer replicas raises
NotReplicated: its write is on the primary, and may be lost with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.commands.core import AsyncScript
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ConnectionError,
    MovedError,
    NoScriptError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from daemon.errors import NotReplicated
from daemon.queue.connection import DEMOTED, RETRIES, AnyRedis, RunIdWatch
from daemon.queue.keys import REPLICATION_MARK, replication_mark

NAMES = (
    "enqueue",
    "enqueue_many",
    "claim",
    "explain",
    "renew",
    "complete",
    "cancel",
    "requeue",
    "reclaim",
    "log",
    "hand_back",
    "heartbeat",
    "prune_workers",
    "primary_age",
    "weights",
    "ready",
    "note_dependent",
    "outbox_take",
    "outbox_settle",
    "started",
    "store",
    "checkpoint",
    "idle_gpu",
)


INCLUDE = "--! include "


def _included(lua: Traversable, name: str, seen: set[str]) -> str:
    """A file of lua/ with each of its `--! include PATH` lines replaced by that file of lua/, its
    own includes put in too; a file already put in (`seen`) is not put in again."""
    lines = []
    for line in (lua / name).read_text().splitlines(keepends=True):
        part = line[len(INCLUDE) :].strip() if line.startswith(INCLUDE) else None
        if part is None:
            lines.append(line)
        elif part not in seen:
            seen.add(part)
            lines.append(_included(lua, part, seen))
    return "".join(lines)


def source(name: str) -> str:
    """The full text of a script as Redis runs it: `_lib.lua`'s rules, then the script with the
    helpers of lib/ it calls and its parts (the scheduler's: claim/), each put in once, at the
    first line that includes it."""
    lua = resources.files("daemon.queue") / "lua"
    return _included(lua, "_lib.lua", set()) + "\n" + _included(lua, f"{name}.lua", set())


class Scripts:
    """One registered script per queue operation."""

    def __init__(self, redis: AnyRedis) -> None:
        self.enqueue: AsyncScript = redis.register_script(source("enqueue"))
        self.enqueue_many: AsyncScript = redis.register_script(source("enqueue_many"))
        self.claim: AsyncScript = redis.register_script(source("claim"))
        self.explain: AsyncScript = redis.register_script(source("explain"))
        self.renew: AsyncScript = redis.register_script(source("renew"))
        self.complete: AsyncScript = redis.register_script(source("complete"))
        self.cancel: AsyncScript = redis.register_script(source("cancel"))
        self.requeue: AsyncScript = redis.register_script(source("requeue"))
        self.reclaim: AsyncScript = redis.register_script(source("reclaim"))
        self.log: AsyncScript = redis.register_script(source("log"))
        self.hand_back: AsyncScript = redis.register_script(source("hand_back"))
        self.heartbeat: AsyncScript = redis.register_script(source("heartbeat"))
        self.prune_workers: AsyncScript = redis.register_script(source("prune_workers"))
        self.primary_age: AsyncScript = redis.register_script(source("primary_age"))
        self.weights: AsyncScript = redis.register_script(source("weights"))
        self.ready: AsyncScript = redis.register_script(source("ready"))
        self.note_dependent: AsyncScript = redis.register_script(source("note_dependent"))
        self.outbox_take: AsyncScript = redis.register_script(source("outbox_take"))
        self.outbox_settle: AsyncScript = redis.register_script(source("outbox_settle"))
        self.started: AsyncScript = redis.register_script(source("started"))
        self.store: AsyncScript = redis.register_script(source("store"))
        self.checkpoint: AsyncScript = redis.register_script(source("checkpoint"))
        self.idle_gpu: AsyncScript = redis.register_script(source("idle_gpu"))


@dataclass(frozen=True, slots=True)
class ReplicaAck:
    """How many replicas a durable write must reach before it is acknowledged, and how long its
    WAIT waits for them."""

    replicas: int
    timeout_ms: int

    @classmethod
    def of(cls, replicas: int, timeout: float) -> ReplicaAck | None:
        """None when no replica is asked for (the primary's word is enough)."""
        return cls(replicas, max(1, round(timeout * 1000))) if replicas > 0 else None


@dataclass(frozen=True, slots=True)
class Command:
    """A plain Redis command that travels in a batch of script calls, as `NAME KEYS... ARGS...`:
    for a write that needs no script (one command is atomic by itself), which would cost Redis
    the script machinery and the shared helpers on every call."""

    name: str


ScriptOrCommand = AsyncScript | Command
BatchCall = tuple[
    ScriptOrCommand, Sequence[Any], Sequence[Any], bool
]  # script or command, keys, args, durable


class ScriptBatch:
    """Script calls collected with `add`, then sent together by `execute` in one round trip;
    with `ack`, the durable ones acknowledged once on enough replicas (see the module doc)."""

    def __init__(
        self,
        redis: AnyRedis,
        ack: ReplicaAck | None = None,
        watch: RunIdWatch | None = None,
        transport: Transport | None = None,
    ) -> None:
        """`watch`: told which node each call goes to, on a Cluster (`RunIdWatch.serving`).
        `transport`: how the batch travels (None: `PlainTransport`, redis-py's own pipeline)."""
        self.redis = redis
        self.ack = ack
        self.watch = watch
        self.transport = transport or PLAIN
        self._calls: list[BatchCall] = []

    def __len__(self) -> int:
        return len(self._calls)

    def add(
        self, script: ScriptOrCommand, keys: Sequence[Any], args: Sequence[Any], *, durable: bool = False
    ) -> int:
        """Queue one call; returns the index of its reply in `execute`'s list."""
        self._calls.append((script, keys, args, durable))
        return len(self._calls) - 1

    async def execute(self) -> list[Any]:
        """Run every call; the replies in order. Raises the first error a call answered with."""
        replies = await self.execute_each()
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    async def execute_each(self) -> list[Any]:
        """Run every call; the replies in order, a call's error (an exception) in its place.
        Raises when Redis could not be asked at all (a connection error)."""
        if not self._calls:
            return []
        replies = await self._send(self._calls)
        refused = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if refused:
            for script in {id(self._calls[i][0]): self._calls[i][0] for i in refused}.values():
                assert isinstance(script, AsyncScript)  # (only EVALSHA is answered NOSCRIPT)
                script.sha = await self.redis.script_load(script.script)
            for i, reply in zip(refused, await self._send([self._calls[i] for i in refused]), strict=True):
                replies[i] = reply
        return replies

    async def _send(self, calls: Sequence[BatchCall]) -> list[Any]:
        """The calls' replies, on one node or, on a Redis Cluster, on the node of each call's slot."""
        if isinstance(self.redis, RedisCluster):
            return await self._send_by_node(calls)
        return await self._send_to(functools.partial(self.transport.exchange, self.redis), calls)

    async def _send_to(self, exchange: Exchange, calls: Sequence[BatchCall]) -> list[Any]:
        """The calls' EVALSHAs written at once on one connection (`exchange`), their replies read
        in order, as a redis-py pipeline does without MULTI: only what a batch of script calls
        needs of it (redis-py's Pipeline object cost each batch more of this process). Then the
        WAIT of its durable calls, if it has any."""
        commands = [
            (script.name, *keys, *args)
            if isinstance(script, Command)
            else ("EVALSHA", script.sha, len(keys), *keys, *args)
            for script, keys, args, _ in calls
        ]
        ack = self.ack if any(durable for *_, durable in calls) else None
        if ack is not None:
            # WAIT counts the replicas that have this connection's last write (Redis 7; 6.2 its
            # last command). A script that wrote nothing (it answered a repeated request as
            # before) would leave that at an older write, made before the first run's, so a
            # write that is always made goes first (`_mark`): Redis replicates in order, so a
            # replica that has it has every earlier write, whoever made it.
            marks = self._mark(calls[0][1][0])
            commands += marks
            commands.append(("WAIT", ack.replicas, ack.timeout_ms))
        replies = await exchange(commands)
        if ack is not None:
            acked = replies.pop()
            for reply in (acked, replies.pop()):  # the WAIT's, and the mark's last command's
                if isinstance(reply, Exception):
                    if moving(reply):  # a Cluster's slot, or node, moved: all of it goes again
                        return [reply] * len(calls)
                    raise reply
            del replies[len(calls) :]  # the mark's other replies
            if acked < ack.replicas:
                for i, (*_, durable) in enumerate(calls):
                    if durable and not isinstance(replies[i], Exception):
                        replies[i] = NotReplicated(acked, ack.replicas, ack.timeout_ms)
                await self._look_for_the_primary()
        return replies

    def _mark(self, key: str) -> list[tuple[Any, ...]]:
        """The write before a WAIT (see `_send_to`). One Redis: a PUBLISH, always replicated and
        never refused at maxmemory. A Cluster sends PUBLISH over its bus instead of replicating
        it, so there it is a key in the slot of `key` (the batch's node) given a day to live:
        PEXPIRE of a key that exists is replicated and, like PUBLISH, allowed at maxmemory; the
        SET before it makes the key once (refused at maxmemory, when the key is nearly always
        there already)."""
        if not isinstance(self.redis, RedisCluster):
            return [("PUBLISH", REPLICATION_MARK, "")]
        mark = replication_mark(key)
        return [("SET", mark, "", "PX", MARK_MS, "NX"), ("PEXPIRE", mark, MARK_MS)]

    async def _send_by_node(self, calls: Sequence[BatchCall]) -> list[Any]:
        """On a Redis Cluster: the calls grouped by the node that serves each one's slot (a
        script's keys share one), each group one round trip, all at once. A group whose node
        could not be reached, and a call answered MOVED, ASK, TRYAGAIN or CLUSTERDOWN (the
        cluster moved its slot, or is failing over), is sent again once the cluster's map is
        read anew, RETRIES times at most: a call that got such an answer never ran, and every
        script is safe to run twice (lua/_lib.lua). A durable group whose WAIT, or the write before
        it, was answered so goes again whole."""
        redis = self.redis
        assert isinstance(redis, RedisCluster)
        await redis.initialize()  # the slot map, once (a no-op after)
        replies: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        for attempt in range(RETRIES + 1):
            groups: dict[str, tuple[ClusterNode, list[int]]] = {}
            for i in todo:
                node = redis.get_node_from_key(calls[i][1][0])
                assert node is not None
                groups.setdefault(node.name, (node, []))[1].append(i)
            if self.watch is not None:  # before the calls leave: a claim on a new node is seen as one
                for name in groups:
                    self.watch.serving(name)
            results = await asyncio.gather(
                *(
                    self._send_to(
                        functools.partial(self.transport.exchange_on, node), [calls[i] for i in group]
                    )
                    for node, group in groups.values()
                ),
                return_exceptions=True,
            )
            todo, failed = [], None
            last = attempt == RETRIES
            for (node, group), result in zip(groups.values(), results, strict=True):
                if isinstance(result, BaseException):
                    if last or not isinstance(result, (ConnectionError, RedisTimeoutError)):
                        raise result
                    todo += group
                    failed = node.name
                    continue
                for i, reply in zip(group, result, strict=True):
                    if not last and moving(reply):
                        todo.append(i)
                    else:
                        replies[i] = reply
            if not todo:
                break
            await asyncio.sleep(min(0.5, 0.05 * 2**attempt))
            with contextlib.suppress(RedisError):  # the map as the cluster has it now
                await redis.nodes_manager.initialize(last_failed_node_name=failed)
            if self.watch is not None:  # one demoted meanwhile is new again if promoted again
                self.watch.primaries &= {node.name for node in redis.get_primaries()}
        return replies

    async def _look_for_the_primary(self) -> None:
        """A primary whose replicas confirm nothing may be one cut off from them, and from the
        sentinels, which promoted a replica meanwhile: ask them (a Sentinel pool drops its idle
        connections when the primary moved, so the caller's next try reaches the new one)."""
        if isinstance(self.redis, RedisCluster):
            return  # a Cluster's nodes say themselves: MOVED, once the cluster has failed over
        pool = self.redis.connection_pool
        if isinstance(pool, SentinelConnectionPool):
            with contextlib.suppress(RedisError):
                await pool.get_master_address()  # type: ignore[no-untyped-call]
        self.transport.drop()  # the pool drops only the connections it holds idle


Exchange = Callable[[list[tuple[Any, ...]]], Awaitable[list[Any]]]


def moving(reply: object) -> bool:
    """What a Cluster node answers for a slot it does not serve now (the call did not run there),
    or a node demoted to a replica answers a write, or WAIT, with (DEMOTED)."""
    if isinstance(reply, MovedError | AskError | TryAgainError | ClusterDownError):
        return True
    return isinstance(reply, ResponseError) and any(text in str(reply) for text in DEMOTED)


MARK_MS = 24 * 3600 * 1000


class Transport(Protocol):
    """How a batch's commands reach Redis and their replies come back: every command written at
    once on one connection, the replies read in order, an error reply (NoScriptError included)
    as the exception in its place."""

    async def exchange(self, redis: Redis, commands: list[tuple[Any, ...]]) -> list[Any]:
        """On one Redis (or a Sentinel group's primary)."""
        ...

    async def exchange_on(self, node: ClusterNode, commands: list[tuple[Any, ...]]) -> list[Any]:
        """On a connection of a Cluster node."""
        ...

    def drop(self) -> None:
        """The primary may have moved: connections kept from batch to batch are made anew."""
        ...


class PlainTransport:
    """A batch as redis-py sends a pipeline without MULTI: its Pipeline object on one Redis (its
    retry, its timeouts, its reply parsing), and on a Cluster node the connection calls redis-py's
    own cluster pipeline makes. The truth the fast path's transport (queue/fast_path.py) must
    match, and the transport while that is off."""

    async def exchange(self, redis: Redis, commands: list[tuple[Any, ...]]) -> list[Any]:
        pipe = redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies

    async def exchange_on(self, node: ClusterNode, commands: list[tuple[Any, ...]]) -> list[Any]:
        connection = node.acquire_connection()
        try:
            await connection.send_packed_command(connection.pack_commands(commands))
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(await connection.read_response())
                except ResponseError as exc:
                    replies.append(exc)
            return replies
        except BaseException:  # stopped between its write and its last reply: never used again
            await connection.disconnect()
            raise
        finally:
            node.release(connection)

    def drop(self) -> None:
        """Nothing is kept: redis-py's pool drops its idle connections itself."""


PLAIN = PlainTransport()


class Calls(Protocol):
    """How a JobQueue makes its script calls: `await calls(script, keys, args)` for the reply, or
    `calls.submit(...)` for a future of it (queued in this turn, in call order). `ahead`, `first`
    and `linger` are the fast path's hints (queue/fast_path.py `Pipeliner`), which plain calls
    need not heed."""

    async def __call__(
        self,
        script: ScriptOrCommand,
        keys: Sequence[Any],
        args: Sequence[Any],
        *,
        ahead: bool = False,
        durable: bool = False,
        linger: float = 0.0,
    ) -> Any: ...

    def submit(
        self,
        script: ScriptOrCommand,
        keys: Sequence[Any],
        args: Sequence[Any],
        *,
        ahead: bool = False,
        durable: bool = False,
        first: bool = False,
        linger: float = 0.0,
    ) -> asyncio.Future[Any]: ...

    async def close(self) -> None: ...


class PlainCalls:
    """Each script call sent by itself when it is made, through plain redis-py (a ScriptBatch of
    one call on `PlainTransport`): the JobQueue's calls while the fast path is off. The fast
    path's hints are not heeded: every call is as urgent as any other, and none waits."""

    def __init__(
        self, redis: AnyRedis, ack: ReplicaAck | None = None, watch: RunIdWatch | None = None
    ) -> None:
        self.redis = redis
        self.ack = ack
        self.watch = watch
        self._in_flight: set[asyncio.Future[Any]] = set()  # submitted, owned here until answered

    async def __call__(
        self,
        script: ScriptOrCommand,
        keys: Sequence[Any],
        args: Sequence[Any],
        *,
        ahead: bool = False,
        durable: bool = False,
        linger: float = 0.0,
    ) -> Any:
        return await self._one(script, keys, args, durable)

    def submit(
        self,
        script: ScriptOrCommand,
        keys: Sequence[Any],
        args: Sequence[Any],
        *,
        ahead: bool = False,
        durable: bool = False,
        first: bool = False,
        linger: float = 0.0,
    ) -> asyncio.Future[Any]:
        """The call, sent from a task of its own: tasks begin in the order they were made, so
        calls submitted in one turn leave in that order."""
        task = asyncio.ensure_future(self._one(script, keys, args, durable))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)
        return task

    async def close(self) -> None:
        """Nothing is kept between calls."""

    async def _one(
        self, script: ScriptOrCommand, keys: Sequence[Any], args: Sequence[Any], durable: bool
    ) -> Any:
        batch = ScriptBatch(self.redis, self.ack, self.watch)
        batch.add(script, keys, args, durable=durable)
        (reply,) = await batch.execute_each()
        if isinstance(reply, Exception):
            raise reply
        return reply
