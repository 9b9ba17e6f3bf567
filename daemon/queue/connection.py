"""How gpupool talks to Redis: one client factory, and a watch on which Redis answers.

Every client the daemon makes comes from `connect`, so timeouts and retries are set in one place:

- A command that gets no reply within SOCKET_TIMEOUT fails with TimeoutError (redis-py 8's own
  default, made explicit). A blocking read (XREAD BLOCK) must therefore block for less than that:
  `block_limit` says how long it may, and `queue.xread` keeps to it. A worker whose XREAD blocked
  for the whole socket timeout timed out on a healthy, idle Redis, and redis-py's retries made
  that one failure a minute long.
- redis-py re-sends a command whose connection broke or timed out, on a fresh connection, up to
  RETRIES times. The first copy may have run (only its reply was lost), so every script is written
  to be run twice with no second effect (daemon/queue/lua/_lib.lua says how each one manages it).
- Commands are packed by hiredis (`PackedConnection`), as redis-py's sync client already does;
  its asyncio one packs them in Python, which was a worker's largest cost per script call.
- `RunIdWatch`: every new connection asks Redis for its run id (INFO server), which changes
  whenever the redis-server process does: a restart, or a replica taking over. Such a Redis may
  have lost its last writes, leases among them, so whoever holds leases re-validates them at once
  (the worker's heartbeat does, on `RunIdWatch.changed`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import hiredis
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection, UnixDomainSocketConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT

log = logging.getLogger(__name__)

# The pool's client: one Redis (a node, or the primary of a Sentinel group), or a Redis Cluster.
AnyRedis = Redis | RedisCluster

SOCKET_TIMEOUT = 5.0  # seconds a command may wait for its reply
CONNECT_TIMEOUT = 5.0
RETRIES = 3  # re-sends of a command whose connection failed (each on a fresh connection)
MAX_CLUSTER_CONNECTIONS = 65536  # per node (connect_cluster)
READ_SIZE = 64 * 1024  # bytes asked of a socket at once by ReplyReader


def block_limit(redis: AnyRedis) -> float:
    """The longest a blocking command may block on `redis`: half its socket timeout, so the reply
    comes well before the client would give up waiting for it."""
    timeout = connection_options(redis).get("socket_timeout")
    return float("inf") if timeout is None else float(timeout) / 2


class _Packed(AbstractConnection):
    """redis-py's asyncio connection with its commands packed by hiredis (C), byte for byte as
    its own Python packer does, in a fraction of its time for a script call of a dozen arguments.

    Its writes leave at once: a command the kernel takes whole (every command, unless the socket's
    buffer is full) is written and done, as a socket write is; only a write that must wait for
    room waits, bounded by the socket timeout. redis-py bounds every write with asyncio.wait_for,
    which on Python 3.11 makes a task of it: one more turn of the loop before each command leaves,
    and more of this process's time per command."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        writer = self._writer
        if (
            writer is None
            or writer.transport.is_closing()
            or not isinstance(command, list)
            or (check_health and self.health_check_interval)
        ):
            await self._send_bounded(command, check_health)  # connecting, or a health check
            return
        writer.writelines(command)
        if writer.transport.get_write_buffer_size():  # the socket's buffer is full: wait for room
            await self._send_bounded([], check_health=False)

    async def _send_bounded(self, command: Any, check_health: bool) -> None:
        """redis-py's write (connecting first if need be, and draining), bounded by the socket
        timeout in a timeout context rather than by wait_for (see the class doc)."""
        timeout = self.socket_timeout
        if not timeout or sys.version_info >= (3, 12):  # 3.12's wait_for makes no task
            await super().send_packed_command(command, check_health)
            return
        self.socket_timeout = None  # so redis-py writes without wait_for, this bounding it instead
        try:
            async with asyncio.timeout(timeout):
                await super().send_packed_command(command, check_health)
        except TimeoutError:  # as redis-py says it (it has dropped the connection)
            raise RedisTimeoutError("Timeout writing to socket") from None
        finally:
            self.socket_timeout = timeout

    def pack_command(self, *args: EncodableT) -> list[bytes]:
        head, rest = args[0], args[1:]
        if isinstance(head, (str, bytes)):  # as redis-py: 'CONFIG GET' is two arguments
            words = (head.encode() if isinstance(head, str) else head).split()
            try:
                return [hiredis.pack_command((*words, *rest))]  # type: ignore[arg-type]
            except TypeError:
                pass  # a bytearray, which hiredis does not take; or what redis-py refuses, saying why
        return super().pack_command(*args)


class PackedConnection(_Packed, Connection):
    """A connection to one Redis node (see `_Packed`)."""


class PackedUnixConnection(_Packed, UnixDomainSocketConnection):
    """A connection through a Unix socket, to a Redis on this machine (see `_Packed`)."""


# What a replica answers a write with: alone (redis-py's ReadOnlyError), inside a script's error,
# or to WAIT.
DEMOTED = ("READONLY You can't write against a read only replica", "WAIT cannot be used with replica")


class PackedSentinelConnection(_Packed, SentinelManagedConnection):
    """A connection to the primary the sentinels name (see `_Packed`); after a failover it finds the
    new one. A connection to a primary since demoted to a replica fails with ConnectionError, so
    that redis-py's retry asks the sentinels again: redis-py does so for a write refused as
    READONLY, and this also for a script whose write was refused so (a script error, to redis-py)
    and for WAIT, which a replica refuses. Every script is safe to run again (lua/_lib.lua); on a
    replica, none wrote anything."""

    async def _send_bounded(self, command: Any, check_health: bool) -> None:
        """A dropped connection is made again where the sentinels say the primary is now: redis-py's
        write would reconnect to the address it had (after a failover gone, or a replica). Once:
        the command's own retry tries again."""
        if not self.is_connected:
            await self._connect_retry()  # type: ignore[no-untyped-call]
        await super()._send_bounded(command, check_health)

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except ResponseError as exc:
            if self.connection_pool.is_master and any(text in str(exc) for text in DEMOTED):
                await self.disconnect()
                raise ConnectionError("the previous primary is now a replica") from exc
            raise


class ReplyReader:
    """The replies of a connection that nothing else reads from (a blocking read's), one at a time,
    parsed by hiredis here: a wait for one that is cancelled loses nothing, and the next wait goes
    on (redis-py's own read drops its connection when cancelled, as it must when others share it)."""

    def __init__(self) -> None:
        self._parser = hiredis.Reader(replyError=ResponseError)

    async def read(self, connection: AbstractConnection) -> Any:
        """The next reply (an error reply as a ResponseError, returned). Raises ConnectionError
        when the connection has closed."""
        stream = connection._reader
        while (reply := self._parser.gets()) is False:
            data = await stream.read(READ_SIZE) if stream is not None else b""
            if not data:
                raise ConnectionError("Connection closed by server.")
            self._parser.feed(data)
        return reply


class RunIdWatch:
    """Remembers the run id of the Redis behind a client; `changed` fires when another one answers.

    One Redis (a node, or the primary a Sentinel group names): another run id is another Redis,
    wherever it answers. A Cluster (`per_node`): each node has its own run id, and a change at one
    is that node restarted; and a primary the pool did not know when the client met the cluster
    (`settle`), which a script batch is about to write to (`serving`), is a replica promoted in a
    failover, or a node added: new to the pool either way.

    `generation` counts the changes, so a caller can tell whether one happened during a call: read
    it before, compare after."""

    def __init__(self, *, per_node: bool = False) -> None:
        self.per_node = per_node
        self.run_ids: dict[str, str] = {}  # address ("" for one Redis) -> run id
        self.primaries: set[str] = set()  # (Cluster) the nodes known to serve the pool's slots
        self.settled = False
        self.generation = 0
        self.changed = asyncio.Event()

    @property
    def run_id(self) -> str | None:
        """The run id last seen (of one Redis; of some node, on a Cluster)."""
        return next(reversed(self.run_ids.values()), None)

    def settle(self, primaries: Iterable[str] = ()) -> None:
        """The client has met the pool's Redis: on a Cluster, `primaries` serve its slots, and any
        other that comes to serve them is new."""
        self.primaries.update(primaries)
        self.settled = True

    def serving(self, address: str) -> None:
        """(Cluster) A batch is about to write to the primary at `address`."""
        if address not in self.primaries:
            self.primaries.add(address)
            if self.settled:
                self._change(f"{address} serves the pool's slots now, a node new to the pool")

    def saw(self, run_id: str, address: str = "") -> None:
        where = address if self.per_node else ""
        before = self.run_ids.pop(where, None)
        self.run_ids[where] = run_id
        if before is not None and run_id != before:
            self._change(f"run id {run_id[:8]} at {address}, was {before[:8]}")

    def _change(self, what: str) -> None:
        self.generation += 1
        self.changed.set()
        log.warning("Redis restarted or failed over (%s)", what)

    async def on_connect(self, connection: AbstractConnection) -> None:
        await connection.on_connect()
        # On a Cluster, redis-py also asks replicas for the slot map: their role says so, and a
        # replica holds nothing of the pool's until it is promoted (then seen as a primary).
        await connection.send_command("INFO", "default" if self.per_node else "server")
        info = await connection.read_response()
        text = info.decode() if isinstance(info, bytes) else str(info)
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if "run_id" in fields and fields.get("role", "master").strip() == "master":
            address = f"{getattr(connection, 'host', '')}:{getattr(connection, 'port', '')}"
            self.saw(fields["run_id"].strip(), address)


def _options(watch: RunIdWatch | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    return {
        "socket_timeout": SOCKET_TIMEOUT,
        "socket_connect_timeout": CONNECT_TIMEOUT,
        "retry": Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.5), RETRIES),
        "redis_connect_func": watch.on_connect if watch is not None else None,
        **kwargs,  # a test's shorter timeout, say
    }


def connect(
    host: str,
    port: int,
    *,
    password: str | None = None,
    username: str | None = None,
    db: int = 0,
    watch: RunIdWatch | None = None,
    unix_socket: str | None = None,
    **kwargs: Any,
) -> Redis:
    """A client (a connection pool) with the pool's timeouts and retries; `watch` is told the run
    id of every connection it opens. With `unix_socket`, through that Unix socket (of a Redis on
    this machine), not host:port."""
    options = _options(watch, kwargs)
    redis = Redis(
        host=host,
        port=port,
        db=db,
        username=username,
        password=password,
        **options,
        unix_socket_path=unix_socket,
    )
    # Redis() takes no connection class, and building its pool by hand would mean repeating its
    # defaults; the pool makes every connection from this attribute, none made yet.
    redis.connection_pool.connection_class = PackedUnixConnection if unix_socket else PackedConnection
    return redis


def connect_sentinel(
    sentinels: Sequence[tuple[str, int]],
    master: str,
    *,
    password: str | None = None,
    username: str | None = None,
    sentinel_password: str | None = None,
    db: int = 0,
    watch: RunIdWatch | None = None,
    **kwargs: Any,
) -> tuple[Redis, Sentinel]:
    """A client of the primary that `sentinels` monitor as `master`, with the pool's timeouts and
    retries, and the Sentinel client it asks them through (the caller closes both). Each new
    connection asks the sentinels where the primary is: after a failover, the first retry of a
    failed command finds the promoted replica, and `watch` sees its run id (a new Redis: the worker
    re-validates its leases, as after a restart)."""
    options = _options(watch, kwargs)
    asking = {  # the sentinels' own password, and the same bounded waits
        "password": sentinel_password,
        "socket_timeout": options["socket_timeout"],
        "socket_connect_timeout": options["socket_connect_timeout"],
    }
    manager = Sentinel(sentinels, sentinel_kwargs=asking, **options)
    redis = manager.master_for(
        master, connection_class=PackedSentinelConnection, db=db, username=username, password=password
    )
    return redis, manager


def connect_cluster(
    nodes: Sequence[tuple[str, int]],
    *,
    password: str | None = None,
    username: str | None = None,
    watch: RunIdWatch | None = None,
    **kwargs: Any,
) -> RedisCluster:
    """A Redis Cluster client that finds the cluster from any of `nodes`, with the pool's timeouts,
    its packed connections, and `watch` (a `per_node` one) told the run id of every node it
    connects to. redis-py routes each command by its key's slot and follows the cluster through
    MOVED replies and failovers; the pool's script batches go to each slot's node themselves
    (scripts.ScriptBatch), and its blocking reads are made per slot (reads.xread)."""
    if watch is not None and not watch.per_node:
        raise ValueError("a Cluster's nodes each have their own run id: watch with RunIdWatch(per_node=True)")
    options = _options(watch, kwargs)
    connect_func = options.pop("redis_connect_func")
    redis = RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in nodes],
        username=username,
        password=password,
        # A node's pool never waits for a free connection: past its bound it raises
        # MaxConnectionsError. One Redis's pool is unbounded; so, near enough, is this (each
        # blocking read of a `logs -f` or a `wait` holds a connection).
        max_connections=MAX_CLUSTER_CONNECTIONS,
        **options,
    )
    # RedisCluster() takes neither a connection class nor a connect hook; every node it meets is
    # made from these arguments, and the startup nodes were already (no connection made yet).
    redis.connection_kwargs["connection_class"] = PackedConnection
    redis.connection_kwargs["redis_connect_func"] = connect_func
    for node in redis.startup_nodes:
        node.connection_class = PackedConnection
        node.connection_kwargs["redis_connect_func"] = connect_func
    return redis


async def meet(redis: AnyRedis, watch: RunIdWatch | None = None) -> None:
    """Ask `redis` for a PONG: on a Cluster, every primary, which then count as the pool's nodes
    for `watch` (`RunIdWatch.settle`). Raises RedisError when one does not answer."""
    if isinstance(redis, RedisCluster):
        await redis.ping(target_nodes=RedisCluster.PRIMARIES)
        primaries = [node.name for node in redis.get_primaries()]
    else:
        await redis.ping()
        primaries = []
    if watch is not None:
        watch.settle(primaries)


def connection_options(redis: AnyRedis) -> dict[str, Any]:
    """The arguments `redis` makes its connections with."""
    if isinstance(redis, RedisCluster):
        return redis.connection_kwargs
    return redis.connection_pool.connection_kwargs
