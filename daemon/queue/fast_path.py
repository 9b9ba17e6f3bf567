"""The GPU-less fast path, the queue's part: every mechanism of the queue that exists only for
short jobs on workers without GPUs, behind one switch (`fast_path` in the config, JobQueue's
`fast_path`; worker/fast_path.py is the worker's part). With it off a JobQueue makes each script
call by itself through plain redis-py (scripts.PlainCalls, scripts.PlainTransport), and no
worker leaves a claim standing; what Redis is asked, and so what any call decides, is the same.

What is here, and why each exists:

- `Pipeliner` batches without being asked (auto-pipelining, as ioredis and node-redis offer):
  script calls made in the same turn of the event loop go out together, as ScriptBatches of up to
  MAX_BATCH calls side by side. The completes of attempts that end together share a round trip.
  No call waits for a timer: the first call of a turn starts the batch's sender, whose first step
  (the next turn) takes every call made until then and writes them at once. A claim a slot waits
  for goes ahead of the others, alone (`submit`'s `ahead` says why). A call that may `linger` (an
  outcome on a worker draining short jobs) waits a little for company: its batch leaves once a
  call that may not is made, or when the call has waited its linger.
- `FastTransport` writes a batch's commands on a redis-py connection and reads their replies
  under one timer, on redis-py internals (`AbstractConnection.send_packed_command`,
  `pack_commands`, `read_response(timeout=...)`, `retry`, the pool's `get_connection` and
  `release`; tests/daemon/queue/test_redis_internals.py fails, naming the one, when any of them
  moves). A Pipeliner's batches go on a connection it keeps (`Lane`) while that one is free.
- `StandingClaims`: an idle worker's next claim left with its JobQueue, sent by the next enqueue
  in the same round trip (`Standing`), so that a job enqueued on an idle single-machine pool
  starts with no claim round trip of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from daemon.errors import NotReplicated
from daemon.job import JobSpec, Lease
from daemon.queue.claims import Capacity, Claims, _ahead_past, _boottime
from daemon.queue.connection import AnyRedis, RunIdWatch
from daemon.queue.failures import unanswered
from daemon.queue.scripts import PLAIN, Calls, PlainCalls, ReplicaAck, ScriptBatch, ScriptOrCommand, Transport


def batch_transport(on: bool) -> Transport:
    """How a JobQueue's explicit batches (JobQueue.batch) travel: the fast path's, or plain."""
    return FastTransport(None) if on else PLAIN


def script_calls(redis: AnyRedis, ack: ReplicaAck | None, watch: RunIdWatch | None, on: bool) -> Calls:
    """How a JobQueue makes its script calls: auto-pipelined (`Pipeliner`), or each by itself."""
    return Pipeliner(redis, ack, watch) if on else PlainCalls(redis, ack, watch)


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


class FastTransport:
    """A batch written at once on a redis-py connection, its replies read under one timer
    (`_exchange`): only what a batch of script calls needs of redis-py's pipeline (its Pipeline
    object cost each batch more of this process). `lane`: a connection to send on when it is free
    (one Redis only; a Pipeliner's)."""

    def __init__(self, lane: Lane | None) -> None:
        self.lane = lane

    def drop(self) -> None:
        if self.lane is not None:
            self.lane.drop()

    async def exchange(self, redis: Redis, commands: list[tuple[Any, ...]]) -> list[Any]:
        pool = redis.connection_pool
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

    async def exchange_on(self, node: ClusterNode, commands: list[tuple[Any, ...]]) -> list[Any]:
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
        self._transport = FastTransport(self._lane)
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
                if not self._pending:  # none waits for it here: a call made later starts a sender
                    return
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
        batch = ScriptBatch(self.redis, self.ack, self.watch, self._transport)
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


@dataclass(eq=False)
class Standing:
    """A claim an idle worker leaves with its JobQueue (`StandingClaims.stand`), as `claim_many`
    would make it: the first `enqueue` through that JobQueue to one of `queues` sends it right
    after its own call, in the same round trip. So in a single-machine pool, whose server enqueues
    through the JobQueue its slots claim through, a job is claimed for an idle slot with no round
    trip of its own. `taken` is set once it is sent; `sent` is then its queue, request number,
    reply and the spec whose enqueue sent it (packed, and as the JobSpec it was packed from: a
    claim that gets a job of that very spec has it at hand, validated, not decoded again). A
    pilot's lifetime is kept as its end (`ends_at`, CLOCK_BOOTTIME) and sent as what is left of
    it then: a claim that stood a while has that much less. While `ready()` is false (the worker
    may not claim now: worker/claim_gate.py) no enqueue sends it."""

    worker: str
    queues: tuple[str, ...]
    count: int
    capacity: Capacity
    ends_at: float | None
    ready: Callable[[], bool] | None = None
    slots: int | None = None  # of `count`, for slots free now (claim_many's `slots`)
    taken: asyncio.Event = field(default_factory=asyncio.Event)
    sent: tuple[str, int, asyncio.Future[Any], tuple[bytes, JobSpec]] | None = None


class StandingClaims(Claims):
    """The standing claims of a JobQueue (which sets `fast_path` and `_standing`): none is left
    while the fast path is off."""

    fast_path: bool
    _standing: list[Standing]

    def stand(
        self,
        worker: str,
        queues: Sequence[str],
        count: int,
        capacity: Capacity | None = None,
        *,
        ready: Callable[[], bool] | None = None,
        slots: int | None = None,
    ) -> Standing | None:
        """Leave `worker`'s next claim, for up to `count` jobs as `claim_many` takes its arguments,
        for the next `enqueue` to one of `queues` to send (see Standing); `withdraw` it when the
        worker goes on otherwise. None while a claim of the worker's is unanswered: that one goes
        again first, in its next `claim_many`. Only a worker without GPUs leaves one: its `ends`
        (backfill) are empty, and no NVML reading ages in it; a pilot's `lifetime` is counted
        down while it stands (Standing). None too while the fast path is off: the worker waits,
        and claims once woken, as a GPU worker does.

        It stands for `queues` up to the first whose head job the worker's last claims kept
        from the later ones (backfill: its GPUs, CPUs and memory), none after: sent alone, to
        one queue, a claim there would keep nothing for that head, and a job of a later queue
        could take what the head waits for. An enqueue to one of those wakes the worker's read
        for work instead, and its claims of every queue, in order, keep the head's need."""
        if not self.fast_path or worker in self._unanswered:
            return None
        room = capacity or Capacity()
        ends_at = None if room.lifetime is None else _boottime() + room.lifetime
        head = self._head_queue.get(worker)
        if head is not None and head in queues:
            queues = queues[: list(queues).index(head) + 1]
        standing = Standing(worker, tuple(queues), count, room, ends_at, ready, slots)
        self._standing.append(standing)
        return standing

    def withdraw(self, standing: Standing) -> bool:
        """Take a standing claim back: True if it was never sent (it claimed nothing), False if it
        was, and `standing_claimed` says what it got."""
        with contextlib.suppress(ValueError):
            self._standing.remove(standing)
        return standing.sent is None

    def _send_standing(self, q: str, enqueued: tuple[bytes, JobSpec]) -> None:
        """An enqueue to `q` has queued its call in this turn, of `enqueued` (its spec, packed and
        as the JobSpec): the first claim standing for `q` goes right after it, in its batch
        (`Pipeliner`), and so sees its job."""
        for standing in self._standing:
            if q in standing.queues and (standing.ready is None or standing.ready()):
                self._standing.remove(standing)
                request = self._next_request(standing.worker)
                room = standing.capacity
                if standing.ends_at is not None:
                    room = dataclasses.replace(room, lifetime=max(0.001, standing.ends_at - _boottime()))
                claim = self._request(standing.worker, q, request, standing.count, room, slots=standing.slots)
                reply = self._call.submit(
                    self.scripts.claim, claim.keys(), [claim.packed()], durable=True, first=True
                )
                standing.sent = (q, request, reply, enqueued)
                self._unanswered[standing.worker] = (q, request)  # until its reply is read
                standing.taken.set()
                return

    async def standing_claimed(self, standing: Standing) -> list[Lease]:
        """The jobs a sent standing claim got. Until its reply is read here it counts as
        unanswered: should it never be (an error, or the worker cancelled meanwhile), the worker's
        next claim (or `settle_claims`) sends it again first, as any of `claim_many`'s."""
        assert standing.sent is not None
        q, request, reply, enqueued = standing.sent
        try:
            got = await self._claim_reply(standing.worker, q, await reply, enqueued)
        except (RedisError, NotReplicated) as exc:
            if not unanswered(exc) and self._unanswered.get(standing.worker) == (q, request):
                del self._unanswered[standing.worker]  # Redis refused it: it claimed nothing
            raise
        if self._unanswered.get(standing.worker) == (q, request):
            del self._unanswered[standing.worker]
        if got.status != b"claimed":
            self._cursors[q] = got.cursors
        # A head it kept (its queue comes before any kept for already: `stand`) is kept from
        # the queues after it by the worker's next standing claim too; a look through the whole
        # of the queue kept for so far that finds no head to keep there ends that.
        if got.kept is not None:
            self._head_queue[standing.worker] = q
        elif got.status != b"claimed" and self._head_queue.get(standing.worker) == q:
            del self._head_queue[standing.worker]
        return _ahead_past(got.leases, standing.count if standing.slots is None else standing.slots)
