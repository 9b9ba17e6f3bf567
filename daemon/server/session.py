"""One client connection: adapts the sans-IO `protocol.ServerConnection` to an asyncio stream.

Bytes read go into the connection; its events drive the work: each request runs as its own task
(requests are multiplexed by id), a CANCEL cancels that task, and every frame the connection
produces is written out. Backpressure: after each read the session awaits `drain()`, so a client
that does not read its replies stops being read from. Timeouts: the handshake must finish within
`handshake_timeout` of the accept (slow-loris), and a connection with nothing in flight is closed
after `idle_timeout` without a byte. A protocol error ends this connection only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import struct
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from daemon.errors import GpupoolError
from daemon.server.channels import ClientEnd
from daemon.server.handlers import Handlers
from daemon.server.idle_watch import IdleWatch
from daemon.server.throttle import Throttle, block
from protocol import (
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_FRAME_SIZE,
    DEFAULT_MAX_IN_FLIGHT,
    NEED_DATA,
    Authenticated,
    CancelRequested,
    ChannelAcked,
    ChannelDataReceived,
    ChannelEndReceived,
    ChannelResized,
    ConnectionClosed,
    ConnectionFailed,
    DecodeNeeded,
    ErrorCode,
    Event,
    GoodbyeReceived,
    NeedData,
    OpenChannel,
    RemoteProtocolError,
    Request,
    RequestReceived,
    ServerConnection,
    StreamItem,
)
from protocol.codec import Message, decode_message
from protocol.connection import State, error_frame
from protocol.frames import FrameType

log = logging.getLogger(__name__)

READ_SIZE = 256 * 1024
# A request payload larger than this is decoded in a thread: msgpack and the checks take time in
# proportion to its size (most with tiny values), and below it the loop may spend that inline.
DECODE_INLINE = 64 * 1024


@dataclass(frozen=True, slots=True)
class Limits:
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    max_connections: int = 1000
    # Connections not yet authenticated, at most: beyond it the oldest of them is closed to make
    # room, so silent sockets can never hold the places of users who authenticate.
    max_unauthenticated: int = 64
    # ... and at most this many from one address: one host cannot keep everyone else waiting.
    max_unauthenticated_per_host: int = 8
    # Bytes of partly received frames across all connections: each may hold up to a maximal frame,
    # and a thousand of them would hold gigabytes. Past it, the connection that needs more is closed.
    max_partial_frames: int = 64 * 1024 * 1024
    # Authenticated connections of one user, at most: one user's scripts cannot take every place.
    max_connections_per_user: int = 64


class FrameBudget:
    """The bytes of partly received frames that every connection holds, against one limit, and
    those of one user's connections against half of it: one user trickling frames they never
    finish cannot take it all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.by_user: Counter[str] = Counter()

    def hold(self, held: tuple[str, int], now: tuple[str, int]) -> str | None:
        """A connection held `held` (its user then, '' before it authenticated, and bytes) and
        holds `now`: what is over its limit when that goes past the budget or the user's half
        of it (and it grew: a connection whose frame completed never is), else None."""
        (before_user, before), (user, size) = held, now
        self.used += size - before
        self.by_user[before_user] -= before
        self.by_user[user] += size
        for name in (before_user, user):
            if self.by_user[name] <= 0:
                del self.by_user[name]
        if size <= before:
            return None
        if self.used > self.limit:
            return "the server holds too many partly received frames; retry, or send smaller requests"
        if user and self.by_user[user] > self.limit // 2:
            return (
                f"{user}'s connections hold more partly received frames than one user may; finish "
                "those first, or send smaller requests"
            )
        return None


PEER_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
LOCAL_PEER = "the local socket"  # what a client on the server's Unix socket is called (it has no address)


def warned_as(user: str | None, host: str) -> str:
    """Whose allowance of warnings (log_limit.py) a connection's count against: its user's once
    known, before that its address block as the throttle counts it (an IPv6 /64), so a host that
    rotates through the addresses it is given gains no fresh allowance with each."""
    return user or block(host)


def peer_host(writer: asyncio.StreamWriter) -> str:
    """Where a connection comes from: its host, or on the local socket the uid of the process
    that connected (each local user a peer of their own, for the bounds and the throttle)."""
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple):
        return str(peer[0])
    if str(peer):
        return str(peer)
    try:
        credentials = writer.get_extra_info("socket").getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, PEER_CREDENTIALS.size
        )
    except (AttributeError, OSError):
        return LOCAL_PEER
    return f"uid {PEER_CREDENTIALS.unpack(credentials)[1]} on {LOCAL_PEER}"


def code_name(code: int) -> str:
    known = ErrorCode.coerce(code)
    return known.name if isinstance(known, ErrorCode) else str(code)


class Session:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handlers: Handlers,
        conn: ServerConnection,
        limits: Limits,
        *,
        on_protocol_error: Callable[[str], None] | None = None,
        budget: FrameBudget | None = None,
        users: Counter[str] | None = None,
        throttle: Throttle | None = None,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.handlers = handlers
        self.conn = conn
        self.limits = limits
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer) or LOCAL_PEER
        self.host = peer_host(writer)
        self._requests: dict[int, asyncio.Task[None]] = {}
        self._channels: dict[int, ClientEnd] = {}  # the open channels' client ends, by request id
        self._closing = False
        self.opened_at = asyncio.get_running_loop().time()
        self.evicted = False
        self._failing = False  # its authentication failed, the verdict held for its turn (_paced)
        self._budget = budget or FrameBudget(limits.max_partial_frames)
        self._held: tuple[str, int] = ("", 0)  # (user, bytes) of a partial frame, as the budget counts it
        self._on_protocol_error = on_protocol_error
        self._users = Counter[str]() if users is None else users  # user -> connections, shared
        self._user: str | None = None  # counted in _users once authenticated
        self._throttle = throttle or Throttle()

    @property
    def requests(self) -> list[asyncio.Task[None]]:
        """The requests still running on this connection."""
        return list(self._requests.values())

    async def run(self) -> None:
        """Serve the connection until it closes; then cancel what is still running and close."""
        try:
            await self._read_loop()
        except ConnectionError:
            pass
        finally:
            await self._finish()

    @property
    def authenticated(self) -> bool:
        return self.conn.state not in (State.AWAIT_HELLO, State.AWAIT_AUTH)

    @property
    def authenticating(self) -> bool:
        """Whether it holds a place only as a connection that may yet authenticate (listener.py
        closes the oldest of those to make room): not authenticated yet, or failed and holding
        its verdict for its turn (a guess, which never will be)."""
        return not self.authenticated or self._failing

    @property
    def user(self) -> str | None:
        """Who it authenticated as (None: not yet)."""
        return self._user

    def evict(self, why: str) -> None:
        """Close a connection that has not authenticated, to make room for one that may (its read
        loop then sees the end of the stream and finishes)."""
        self.evicted = True
        log.info("closing %s: %s", self.peer, why)
        self.close_saying(ErrorCode.UNAVAILABLE, f"Connection closed: {why}; reconnect.")

    def close_saying(self, code: ErrorCode, sentence: str) -> None:
        """Close the connection now, telling the client why: its requests end with `code` and
        `sentence`, and its read loop sees the stream's end and finishes."""
        with contextlib.suppress(ConnectionError, RuntimeError):
            self._write(self.conn.abort(code, sentence))
        self.writer.close()

    def goodbye(self, reason: str) -> None:
        """The server is stopping: tell the client to start nothing new (in-flight ones finish)."""
        if self.conn.state is State.READY:
            self._write(self.conn.goodbye(reason))

    async def _read_loop(self) -> None:
        handshake_deadline = asyncio.get_running_loop().time() + self.limits.handshake_timeout

        def deadline(started: float) -> float:
            """When a read that began at `started` must have had its bytes."""
            return started + self.limits.idle_timeout if self.authenticated else handshake_deadline

        watch = IdleWatch(deadline)
        try:
            await self._read_until_over(watch)
        finally:
            watch.close()

    async def _read_until_over(self, watch: IdleWatch) -> None:
        while True:
            ready = self.authenticated
            try:
                data = await watch.read(self.reader, READ_SIZE)
            except TimeoutError:
                if ready and self.conn.in_flight:
                    continue  # a long request (log follow, wait) is not idleness
                code = ErrorCode.IDLE_TIMEOUT if ready else ErrorCode.HANDSHAKE_TIMEOUT
                what = (
                    f"idle for {self.limits.idle_timeout:g} s" if ready else "handshake not finished in time"
                )
                log.info("closing %s: %s", self.peer, what)
                self._write(self.conn.abort(code, f"Connection closed: {what}; reconnect when needed."))
                if self._on_protocol_error is not None:
                    self._on_protocol_error(code.name)
                return
            self.conn.receive_data(data)
            if not await self._process_events():
                return
            held = (self._user or "", self.conn.buffered)
            if held != self._held:
                why = self._budget.hold(self._held, held)
                self._held = held
                if why is not None:
                    self.handlers.warnings.warning(
                        log, warned_as(self._user, self.host), "closing %s: %s", self.peer, why
                    )
                    self._write(self.conn.abort(ErrorCode.UNAVAILABLE, f"Connection closed: {why}."))
                    return
            await self.writer.drain()

    async def _next_event(self) -> Event | NeedData:
        """The connection's next event; a large request decoded in a thread first (DecodeNeeded),
        an authentication's outcome paced by the throttle."""
        event = self.conn.next_event()
        if not isinstance(event, DecodeNeeded):
            return await self._paced(event)
        try:
            result: Message | RemoteProtocolError = await asyncio.to_thread(
                decode_message, FrameType.REQUEST, event.payload
            )
        except RemoteProtocolError as exc:
            result = exc
        return self.conn.decoded(event.request_id, result)

    async def _process_events(self) -> bool:
        """Handle every event the bytes so far produced; False once the connection is over. A
        large request is decoded in a thread: its msgpack may take a second of Python, and the
        loop serves every other connection meanwhile."""
        while True:
            event = await self._next_event()
            self._write(self.conn.data_to_send())
            match event:
                case RequestReceived(request_id=rid, message=message):
                    if isinstance(message, OpenChannel):  # now: its input may be in these very bytes
                        self._channels[rid] = self._client_end(rid)
                    self._requests[rid] = asyncio.create_task(
                        self._serve(rid, message), name=f"request-{rid}"
                    )
                case (
                    CancelRequested()
                    | ChannelDataReceived()
                    | ChannelEndReceived()
                    | ChannelAcked()
                    | ChannelResized()
                ):
                    self._to_request(event)
                case Authenticated(user=user, peer=client):
                    log.debug("%s authenticated as %s (%s)", self.peer, user, client)
                    if not self._admit(user):
                        return False
                case GoodbyeReceived():
                    pass
                case ConnectionFailed(code=code, message=message, by_peer=by_peer):
                    log.info("closing %s: protocol error %s: %s", self.peer, code_name(code), message)
                    if not by_peer and self._on_protocol_error is not None:
                        self._on_protocol_error(code_name(code))
                    return False
                case ConnectionClosed():
                    return False
                case _:
                    if event is NEED_DATA:
                        return True

    def _to_request(
        self,
        event: CancelRequested | ChannelDataReceived | ChannelEndReceived | ChannelAcked | ChannelResized,
    ) -> None:
        """A cancel to its request's task; input of an open channel to its relay (none: its
        request is ending, and the input is dropped)."""
        end = self._channels.get(event.request_id)
        match event:
            case CancelRequested(request_id=rid):
                if task := self._requests.get(rid):
                    task.cancel()
            case ChannelDataReceived(data=data) if end is not None:
                end.received(data)
            case ChannelEndReceived() if end is not None:
                end.ended()
            case ChannelAcked() if end is not None:
                end.acked()
            case ChannelResized(rows=rows, cols=cols) if end is not None:
                end.resized(rows, cols)
            case _:
                pass

    async def _paced(self, event: Event | NeedData) -> Event | NeedData:
        """`event`, once the throttle (throttle.py) has counted an authentication's outcome and
        held its answer while the user name is in back-off; ConnectionClosed (the answer dropped,
        a refusal sent) when its turn is too far off, or its address is in back-off."""
        match event:
            case Authenticated(user=user):
                failed = False
            case ConnectionFailed(code=ErrorCode.AUTH_FAILED, by_peer=False):
                user, failed = self.conn.claimed_user or "", True
            case _:
                return event
        now = asyncio.get_running_loop().time()
        # A connection opened before its address was throttled is refused here, as a new one
        # would be at its accept (listener.py): opening many first gains no guesses.
        backoff = self._throttle.refused(self.host, now)
        wait = None if backoff else self._throttle.wait(self.host, user, now)
        if failed and not backoff:
            self._throttle.failed(self.host, user, now)
        if wait is None:
            self.conn.data_to_send()  # the verdict is never sent: a refusal says nothing of the token
            why = (
                f"too many failed authentications from {self.host}; retry in {math.ceil(backoff)} s"
                if backoff
                else f"too many failed authentications as {user}; retry in {self._throttle.most_wait:g} s"
            )
            log.info("closing %s: %s", self.peer, why)
            self._write(error_frame(0, ErrorCode.TOO_MANY_REQUESTS, f"Connection closed: {why}."))
            return ConnectionClosed()
        if not failed:
            self._throttle.succeeded(self.host, user)
        if wait:
            self._failing = failed
            await asyncio.sleep(wait)
        return event

    def _admit(self, user: str) -> bool:
        """Count the connection as `user`'s; False (and the connection ended) past their limit."""
        if self._users[user] >= self.limits.max_connections_per_user:
            why = (
                f"{user} has {self.limits.max_connections_per_user} connections open, the "
                "most one user may; close some (one connection carries many requests)"
            )
            self.handlers.warnings.warning(log, user, "closing %s: %s", self.peer, why)
            self._write(self.conn.abort(ErrorCode.UNAVAILABLE, f"Connection closed: {why}."))
            return False
        self._users[user] += 1
        self._user = user
        return True

    def _client_end(self, rid: int) -> ClientEnd:
        return ClientEnd(
            self._sender(rid),
            lambda: self.conn.output_room(rid),
            lambda size: self._write(self.conn.credit(rid, size)),
        )

    def _sender(self, rid: int) -> Callable[[StreamItem], Awaitable[None]]:
        async def send(item: StreamItem) -> None:
            self._write(self.conn.stream(rid, item))
            await self.writer.drain()

        return send

    async def _serve(self, rid: int, message: Request) -> None:
        user = self.conn.user or ""
        send = self._sender(rid)
        try:
            reply = await self.handlers.handle(message, user, send, self._channels.get(rid))
            self._write(self.conn.reply(rid, reply))
        except GpupoolError as exc:
            self._write(self.conn.error(rid, ErrorCode(exc.code), exc.message))
        except asyncio.CancelledError:
            if self._closing:
                raise
            # the client cancelled this request: it still gets its final frame
            self._write(self.conn.error(rid, ErrorCode.CANCELLED, "Cancelled at the client's request."))
        except ConnectionError:
            pass
        except Exception:  # noqa: BLE001 - logged with its traceback; one broken request must not end the server
            what = type(message).__name__
            self.handlers.warnings.warning(
                log,
                user,
                "request %d (%s) from %s failed",
                rid,
                what,
                self.peer,
                level=logging.ERROR,
                exc_info=True,
            )
            self._write(
                self.conn.error(rid, ErrorCode.INTERNAL, "Internal server error; see the server log.")
            )
        finally:
            self._requests.pop(rid, None)
            self._channels.pop(rid, None)

    def _write(self, data: bytes) -> None:
        if data and not self.writer.is_closing():
            self.writer.write(data)

    async def _finish(self) -> None:
        self._closing = True
        if self._user is not None:
            self._users[self._user] -= 1
            if not self._users[self._user]:
                del self._users[self._user]
            self._user = None
        self._budget.hold(self._held, ("", 0))
        self._held = ("", 0)
        for task in list(self._requests.values()):
            task.cancel()
        try:
            if self._requests:
                await asyncio.gather(*self._requests.values(), return_exceptions=True)
        finally:
            # Closed even when this wait is cancelled again (the listener's stop re-cancels every
            # RECANCEL_SECONDS): a request slow to end must not leave the transport to the GC.
            self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()
