"""The queue's Lua scripts, loaded from daemon/queue/lua/ with the shared helpers of `_lib.lua` prepended.

Each script's header comment says what it guarantees. redis-py's Script objects run by EVALSHA
and fall back to loading the script on NOSCRIPT, so they survive a Redis restart.

`ScriptBatch` sends several script calls in ONE round trip. redis-py's own pipelined scripts ask
Redis `SCRIPT EXISTS` before every pipeline, a second round trip; a batch sends EVALSHA straight
away and only on a NOSCRIPT answer (Redis restarted or flushed its script cache) loads the
missing scripts and re-sends the calls that were refused, which therefore never ran.

`Pipeliner` batches without being asked (auto-pipelining, as ioredis and node-redis offer): script
calls made in the same turn of the event loop go out together, as ScriptBatches of up to MAX_BATCH
calls side by side (a lone call as a plain EVALSHA). The completes of attempts that end together
share a round trip. No call waits for a timer: the first call of a turn starts the batch's
sender, whose first step (the next turn) takes every call made until then and writes them at
once. A claim a slot waits for goes ahead of the others, alone (`submit`'s `ahead` says why). A
call that may `linger` (an outcome on a worker draining short jobs) waits a little for company:
its batch leaves once a call that may not is made, or when the call has waited its linger.
Its batches go out on a connection it keeps (`Lane`) while that one is free, on one from the pool
while it is not.

Durable calls (enqueues, outcomes) are acknowledged only once `ReplicaAck.replicas` replicas have
them: a batch holding one ends with a WAIT, in the same round trip, which covers every write the
batch made on its connection. A durable call whose batch's WAIT counted fewer replicas raises
NotReplicated: its write is on the primary, and may be lost with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, NamedTuple

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection
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
    "release",
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
)


INCLUDE = "--! include "


def source(name: str) -> str:
    """The full text of a script as Redis runs it: the shared helpers, then the script, each of its
    `--! include PATH` lines replaced by that file of lua/ (the scheduler's parts: lua/claim/)."""
    lua = resources.files("daemon.queue") / "lua"
    lines = []
    for line in (lua / f"{name}.lua").read_text().splitlines(keepends=True):
        part = line[len(INCLUDE) :].strip() if line.startswith(INCLUDE) else None
        lines.append((lua / part).read_text() if part else line)
    return (lua / "_lib.lua").read_text() + "\n" + "".join(lines)


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
        self.release: AsyncScript = redis.register_script(source("release"))
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


class Lane:
    """A connection that one sender keeps from batch to batch, for one batch at a time (one
    Redis, or a Sentinel group's primary). Taking a connection from redis-py's pool and giving it
    back cost every batch time on the path to a job's start: the pool's lock,
    a look at the socket, and four metric updates each way. A batch that finds the lane in use
    takes one from the pool, as every batch did. The connection is the pool's still (closed with
    it, remade when it broke), never given back: it is used again at once."""

    def __init__(self) -> None:
        self.connection: AbstractConnection | None = None
        self.busy = False
        self.stale = False  # to be closed before its next batch

    def drop(self) -> None:
        """The next batch on the lane connects anew (and, in a Sentinel group, asks the sentinels
        where the primary is). A batch out on it now is left to finish: closing the connection
        under it would only make it send everything again."""
        self.stale = True


class ScriptBatch:
    """Script calls collected with `add`, then sent together by `execute` in one round trip;
    with `ack`, the durable ones acknowledged once on enough replicas (see the module doc)."""

    def __init__(
        self,
        redis: AnyRedis,
        ack: ReplicaAck | None = None,
        watch: RunIdWatch | None = None,
        lane: Lane | None = None,
    ) -> None:
        """`watch`: told which node each call goes to, on a Cluster (`RunIdWatch.serving`).
        `lane`: a connection to send on when it is free (one Redis only)."""
        self.redis = redis
        self.ack = ack
        self.watch = watch
        self.lane = lane
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
        return await self._send_to(self._exchange, calls)

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
                    self._send_to(functools.partial(_exchange_on, node), [calls[i] for i in group])
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
        if self.lane is not None:  # the pool drops only the connections it holds idle
            self.lane.drop()

    async def _exchange(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        assert isinstance(self.redis, Redis)
        pool = self.redis.connection_pool
        lane = self.lane
        if lane is not None and not lane.busy:
            lane.busy = True
            try:
                if lane.stale:  # before any await: a drop while this one connects stands
                    lane.stale = False
                    if lane.connection is not None:
                        await lane.connection.disconnect(nowait=True)
                if lane.connection is None:
                    lane.connection = await pool.get_connection()  # type: ignore[no-untyped-call]
                kept = lane.connection
                try:
                    return await _exchange_retried(kept, commands)
                except BaseException:
                    # Stopped between its write and its last reply (an error, a cancel), it could
                    # have replies to come that the next batch would take for its own. redis-py
                    # closes a connection whose write or read was interrupted; closed here too,
                    # so that no later version can leave one open, and given back to the pool.
                    lane.connection = None
                    await kept.disconnect(nowait=True)
                    await pool.release(kept)
                    raise
            finally:
                lane.busy = False
        connection: AbstractConnection = await pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            return await _exchange_retried(connection, commands)
        finally:
            await pool.release(connection)


Exchange = Callable[[list[tuple[Any, ...]]], Awaitable[list[Any]]]


def moving(reply: object) -> bool:
    """What a Cluster node answers for a slot it does not serve now (the call did not run there),
    or a node demoted to a replica answers a write, or WAIT, with (DEMOTED)."""
    if isinstance(reply, MovedError | AskError | TryAgainError | ClusterDownError):
        return True
    return isinstance(reply, ResponseError) and any(text in str(reply) for text in DEMOTED)


MARK_MS = 24 * 3600 * 1000


async def _exchange_on(node: ClusterNode, commands: list[tuple[Any, ...]]) -> list[Any]:
    """`_exchange` on a connection of a Cluster node; one that failed is dropped."""
    connection = node.acquire_connection()
    try:
        return await _exchange(connection, commands)
    except BaseException:
        await connection.disconnect()
        raise
    finally:
        node.release(connection)


async def _exchange_retried(connection: AbstractConnection, commands: list[tuple[Any, ...]]) -> list[Any]:
    """`_exchange`; a broken connection is dropped and the whole batch sent again on it, made
    anew, as the client's Retry says: every script is safe to run twice (lua/_lib.lua)."""
    replies: list[Any] = await connection.retry.call_with_retry(
        lambda: _exchange(connection, commands), lambda _error: connection.disconnect()
    )
    return replies


async def _exchange(connection: AbstractConnection, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Send `commands` in one write; their replies, an error reply (NoScriptError included) as
    the exception in its place. The replies come within the socket timeout, all of them under one
    timer: redis-py's read makes a timeout context for each reply (a timer armed and cancelled,
    for every reply of every batch). Past it the connection is dropped and redis-py's
    TimeoutError raised, as its own read does (the client's Retry sends the batch again)."""
    await connection.send_packed_command(connection.pack_commands(commands))
    replies: list[Any] = []
    try:
        async with asyncio.timeout(connection.socket_timeout):
            for _ in commands:
                try:
                    replies.append(await connection.read_response(timeout=math.inf))  # (no timer)
                except ResponseError as exc:
                    replies.append(exc)
    except TimeoutError:  # the timer's (redis-py's read, cancelled by it, closed the connection)
        await connection.disconnect(nowait=True)
        raise RedisTimeoutError("Timeout reading the replies of a batch from Redis") from None
    return replies


class Call(NamedTuple):
    """One caller's call, queued for a batch (Pipeliner.submit says what `first` is)."""

    script: ScriptOrCommand
    keys: Sequence[Any]
    args: Sequence[Any]
    durable: bool
    future: asyncio.Future[Any]
    first: bool


MAX_BATCH = 32  # calls per pipeline; more in one turn go out as several pipelines at once


class Pipeliner:
    """`await pipeliner(script, keys, args)`: one script call, sent with the others made in the
    same event-loop turn (see the module doc). A call's error is raised to its caller alone; a
    connection error to every caller of its batch. A caller that is cancelled while its batch is
    in flight cannot unsend its call, as with any Redis command. With `ack`, durable calls are
    acknowledged once on that many replicas (ScriptBatch)."""

    def __init__(
        self, redis: AnyRedis, ack: ReplicaAck | None = None, watch: RunIdWatch | None = None
    ) -> None:
        self.redis = redis
        self.ack = ack
        self.watch = watch  # see ScriptBatch
        self._pending: list[Call] = []
        self._ahead: list[Call] = []  # calls that go before the others (`submit(ahead=True)`)
        self._ahead_answered: asyncio.Future[None] | None = None  # while those are in flight
        self._in_flight: set[asyncio.Task[None]] = set()
        self._lane = None if isinstance(redis, RedisCluster) else Lane()
        # While every pending call may linger: the loop time until which the first of them may
        # wait. The sender waits for `_company` meanwhile, set by `_hurry`: at that time (the
        # `_linger` timer), or when a call that may not wait is made.
        self._linger_until: float | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._company = asyncio.Event()

    async def close(self) -> None:
        """Give the lane's connection back to the pool, for a queue that is done with (an agent's
        view, worker/hosted.py: the pool would hold one per view ever made). A call made after
        takes a connection of the pool's as usual."""
        lane = self._lane
        if lane is not None and lane.connection is not None and not lane.busy:
            connection, lane.connection = lane.connection, None
            assert isinstance(self.redis, Redis)
            await self.redis.connection_pool.release(connection)

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
        return await self.submit(script, keys, args, ahead=ahead, durable=durable, linger=linger)

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
        """Queue one call for this turn's batch; its reply, or its error, comes in the future.
        `ahead`: a call on the path to a job's start (a claim), which no other script may delay:
        it travels in a batch of its own, and the calls made with it or while it is in flight
        leave once it is answered (Redis answers a batch once it has run it all, and then a claim
        would wait for the outcome of the job whose slot it fills). `first`: a call on that path
        that travels with others (a standing claim, after its enqueue): its caller has its reply
        a turn before theirs, so the job starts before their next steps (a reply to a client).
        `linger`: seconds the call may wait for others to share its round trip (an outcome while
        more end soon: one write, and one wake of Redis, for several); any call made meanwhile
        that may not wait sends them all at once."""
        loop = asyncio.get_running_loop()
        if not self._pending and not self._ahead:
            # The batch's sender, which takes every call made before its first step (in this
            # turn, and those ahead of it in the next) and writes them at once.
            self._own(loop.create_task(self._send_pending()))
            self._linger_until = loop.time() + linger if linger > 0 and not ahead else None
        elif linger <= 0 or ahead:
            self._hurry()
        future: asyncio.Future[Any] = loop.create_future()
        (self._ahead if ahead else self._pending).append(Call(script, keys, args, durable, future, first))
        return future

    def _own(self, task: asyncio.Task[None]) -> None:
        self._in_flight.add(task)  # owned here until it has answered every caller
        task.add_done_callback(self._in_flight.discard)

    async def _send_pending(self) -> None:
        """Send what is queued, the calls ahead first, until nothing is left: a call queued while
        this sender waits (while another sender is between its steps, no new one is started)."""
        while True:
            # A caller cancelled before its batch left: its call is dropped, never sent.
            ahead, self._ahead = [c for c in self._ahead if not c.future.done()], []
            if ahead:
                answered = self._ahead_answered = asyncio.get_running_loop().create_future()
                try:
                    await self._send(ahead)
                finally:
                    answered.set_result(None)
                await asyncio.sleep(0)  # its callers go on first (a job's start), then the rest
                continue
            if self._ahead_answered is not None and not self._ahead_answered.done():
                await asyncio.shield(self._ahead_answered)  # another sender's, still on its way
                continue
            if self._linger_until is not None:
                try:
                    await self._wait_for_company(self._linger_until)
                except asyncio.CancelledError:  # the loop is shutting down: they never leave
                    for call in self._pending:
                        call.future.cancel()
                    self._pending = []
                    raise
                continue  # (a call ahead may have come meanwhile)
            calls, self._pending = [c for c in self._pending if not c.future.done()], []
            if not calls:
                return
            # Batches of at most MAX_BATCH calls, each on its own connection: a caller waits for
            # its batch's replies to be read, so a huge batch would make every caller wait long.
            for start in range(MAX_BATCH, len(calls), MAX_BATCH):
                self._own(asyncio.ensure_future(self._send(calls[start : start + MAX_BATCH])))
            await self._send(calls[:MAX_BATCH])

    async def _wait_for_company(self, until: float) -> None:
        """Every call pending may linger: wait until the first of them has waited its linger, or
        a call that may not wait is made (a second sender, between its steps, waits with it)."""
        if self._linger is None:
            self._company.clear()
            self._linger = asyncio.get_running_loop().call_at(until, self._hurry)
        await self._company.wait()

    def _hurry(self) -> None:
        """The calls pending leave now."""
        self._linger_until = None
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
            self._company.set()

    async def _send(self, calls: list[Call]) -> None:
        batch = ScriptBatch(self.redis, self.ack, self.watch, self._lane)
        for call in calls:
            batch.add(call.script, call.keys, call.args, durable=call.durable)
        try:
            replies = await batch.execute_each()
        except asyncio.CancelledError:  # the loop is shutting down
            for call in calls:
                call.future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the callers, who raise it
            for call in calls:
                if not call.future.done():  # a copy each: one object raised in many tasks tangles them
                    call.future.set_exception(copy.copy(exc))
            return
        answers = list(zip(calls, replies, strict=True))
        if any(call.first for call in calls):
            _answer([(call, reply) for call, reply in answers if call.first])
            answers = [(call, reply) for call, reply in answers if not call.first]
            try:
                await asyncio.sleep(0)  # their callers go on first (a job's start), then the rest
            except asyncio.CancelledError:
                for call, _ in answers:
                    call.future.cancel()
                raise
        _answer(answers)


def _answer(answers: list[tuple[Call, Any]]) -> None:
    """Each call's reply (or error reply) to its caller, unless the caller was cancelled."""
    for call, reply in answers:
        future = call.future
        if future.done():
            continue
        if isinstance(reply, Exception):
            future.set_exception(reply)
        else:
            future.set_result(reply)
