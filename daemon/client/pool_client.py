"""The async client of the pool server: one connection, many concurrent requests.

`PoolClient.connect()` opens the connection and authenticates (to the first of the pool's servers
that answers, when it has several); `call()` sends a request and returns its reply; `stream()`
yields a streaming request's items and then its final reply; `move_on()` connects to another of
the pool's servers when this one went away. A reader task
feeds the sans-IO `protocol.ClientConnection` and routes events to the request they belong to; a
semaphore keeps the requests in flight within the server's limit, so callers may pipeline freely.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from daemon.address import unix_path
from daemon.aio import cancel_and_wait
from daemon.client import session
from daemon.client.session import AuthFailed, ClientError, ServerUnreachable, not_sent, parse_address
from protocol import (
    NEED_DATA,
    Authenticated,
    ChannelClosed,
    ChannelCredit,
    ChannelOutput,
    ChannelResize,
    ConnectionClosed,
    ConnectionFailed,
    GoodbyeReceived,
    LocalProtocolError,
    OpenChannel,
    PongReceived,
    Reply,
    ReplyReceived,
    Request,
    RequestFailed,
    StreamItem,
)

__all__ = ["AuthFailed", "ClientError", "PoolClient", "ServerUnreachable", "parse_address"]

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Reply)
_Item = ReplyReceived | RequestFailed | ConnectionFailed | ConnectionClosed


class PoolClient:
    def __init__(
        self,
        address: str,
        user: str,
        token: str | None,
        *,
        tls_ca: str | None = None,
        tls: str = "auto",
        tls_pin: str | None = None,
    ) -> None:
        """`address`: one server, or several of one pool, comma-separated (session.addresses).
        `tls`: "auto" speaks TLS to a server beyond loopback (verified by `tls_ca`, else by
        `tls_pin`, else pinned on first use: known_servers.py), or to any with `tls_ca` or
        `tls_pin`; "on" always; "off" never."""
        self.targets = session.addresses(address)
        self.address = self.targets[0]
        self.host, self.port = parse_address(self.address)
        self.user = user
        self._token = token
        self.conn = session.connection(user, token)
        self.tls_ca = tls_ca
        self.tls_pin = tls_pin
        self._tls_mode = tls
        self.tls = session.wants_tls(self.host, tls, tls_ca, tls_pin)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Queue[_Item]] = {}
        self._slots = asyncio.Semaphore(1)
        self._closed: ClientError | None = None

    @property
    def closed(self) -> ClientError | None:
        """Why the connection ended (every request on it fails so), or None while it is open."""
        return self._closed

    async def __aenter__(self) -> PoolClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self, handshake_seconds: float = 10.0) -> None:
        """Connect to the first of the pool's servers that answers and lets this client in."""
        for i, address in enumerate(self.targets):
            try:
                await self._connect(address, handshake_seconds)
                return
            except ServerUnreachable as exc:
                if i + 1 == len(self.targets):
                    raise
                session.moving_on(self.targets[i + 1], exc)

    async def move_on(self, why: ClientError) -> bool:
        """The server went away (`why`): connect to another of the pool's servers, those after it
        first. False when the pool has no other; raises when none of them answers. Only between
        requests: one still open on this connection would be answered by none."""
        at = self.targets.index(self.address)
        others = self.targets[at + 1 :] + self.targets[:at]
        if not others:
            return False
        await self.close()
        for address in others:
            session.moving_on(address, why)
            try:
                await self._connect(address)
                return True
            except ServerUnreachable as exc:
                why = exc
        raise why

    async def _connect(self, address: str, handshake_seconds: float = 10.0) -> None:
        self.address = address
        self.host, self.port = parse_address(address)
        self.tls = session.wants_tls(self.host, self._tls_mode, self.tls_ca, self.tls_pin)
        self.conn = session.connection(self.user, self._token)
        self._closed = None
        self._pending = {}
        ctx = session.tls_context(self.tls_ca) if self.tls else None
        try:
            path = unix_path(self.host)
            name = session.tls_name(self.host) if ctx else None
            opening = (
                asyncio.open_unix_connection(path, ssl=ctx, server_hostname=name)
                if path is not None
                else asyncio.open_connection(self.host, self.port, ssl=ctx)
            )
            self._reader, self._writer = await asyncio.wait_for(opening, handshake_seconds)
        except (OSError, TimeoutError) as exc:
            raise session.unreachable(self.address, exc) from None
        assert self._writer is not None
        if ctx is not None:
            try:
                session.check_pin(
                    self.address, self.tls_ca, self._writer.get_extra_info("ssl_object"), self.tls_pin
                )
            except BaseException:
                await self.close()
                raise
        self._writer.write(self.conn.start())
        try:
            hello = await asyncio.wait_for(self._handshake(), handshake_seconds)
        except TimeoutError:
            await self.close()
            raise ServerUnreachable(f"the server at {self.address} did not finish the handshake") from None
        except OSError as exc:  # reset while letting this client in
            await self.close()
            raise session.unreachable(self.address, exc) from None
        except session.ClosedAtHandshake:
            await self.close()
            if not self.tls and (why := await asyncio.to_thread(session.plain_to_tls, self.address)):
                raise why from None
            raise
        except BaseException:  # refused (AuthFailed), or gone (ServerUnreachable): nothing left open
            await self.close()
            raise
        self._slots = asyncio.Semaphore(hello.max_in_flight)
        self._reader_task = asyncio.create_task(self._read_loop(), name="poolctl-reader")

    async def _handshake(self) -> Authenticated:
        assert self._reader is not None
        assert self._writer is not None
        while True:
            data = await self._reader.read(65536)
            self.conn.receive_data(data)
            while (event := self.conn.next_event()) is not NEED_DATA:
                self._writer.write(self.conn.data_to_send())
                if (welcome := session.handshake_outcome(event, self.address, self.user)) is not None:
                    return welcome
            self._writer.write(self.conn.data_to_send())

    async def _read_loop(self) -> None:
        assert self._reader is not None
        assert self._writer is not None
        try:
            while True:
                data = await self._reader.read(256 * 1024)
                self.conn.receive_data(data)
                while (event := self.conn.next_event()) is not NEED_DATA:
                    self._writer.write(self.conn.data_to_send())
                    match event:
                        case ReplyReceived(request_id=rid) | RequestFailed(request_id=rid):
                            if (q := self._pending.get(rid)) is not None:
                                q.put_nowait(event)
                        case ConnectionFailed() | ConnectionClosed():
                            self._fail(event)
                            return
                        case GoodbyeReceived() | PongReceived() | Authenticated():
                            pass
        except (ConnectionError, OSError):
            self._fail(ConnectionClosed())

    def _fail(self, event: ConnectionFailed | ConnectionClosed) -> None:
        """The connection ended: every request waiting fails, as its end says."""
        self._fail_all(session.connection_ended(event, self.address))

    def _fail_all(self, why: ClientError) -> None:
        """Every request waiting fails with `why` (and any made later)."""
        self._closed = why
        for q in self._pending.values():
            q.put_nowait(ConnectionClosed())

    async def stream(self, request: Request) -> AsyncIterator[Reply | StreamItem]:
        """Send `request`; yield each streamed item, then the final reply. Raises ClientError."""
        if self._closed is not None:
            raise self._closed
        assert self._writer is not None
        async with self._slots:
            try:
                rid, data = self.conn.request(request)
            except LocalProtocolError as exc:  # too large, or the server said goodbye first
                raise not_sent(exc, self.address) from None
            q: asyncio.Queue[_Item] = asyncio.Queue()
            self._pending[rid] = q
            self._writer.write(data)
            try:
                await self._writer.drain()
                while True:
                    match await q.get():
                        case ReplyReceived(message=message, final=final):
                            yield message
                            if final:
                                return
                        case RequestFailed(code=code, message=message):
                            raise ClientError(message, code)
                        case _:
                            raise self._closed or ClientError("the connection closed")
            finally:
                del self._pending[rid]
                writer = self._writer  # None once close() has run
                if rid in self.conn.in_flight and writer is not None and not writer.is_closing():
                    writer.write(self.conn.cancel(rid))

    async def channel(
        self,
        request: OpenChannel,
        output: Callable[[str, bytes], Awaitable[None]],
        stdin: AsyncIterator[bytes | ChannelResize] | None = None,
    ) -> ChannelClosed:
        """Open a channel (docs/PROTOCOL.md §5): each piece of output goes to `output(stream,
        data)` and is acknowledged once it returns; `stdin` (when `request.stdin`) is sent as the
        window's credit allows, then its end. Returns the final ChannelClosed; raises ClientError.
        Cancelling it cancels the channel (the server kills the command)."""
        if self._closed is not None:
            raise self._closed
        assert self._writer is not None
        async with self._slots:
            try:
                rid, data = self.conn.request(request)
            except LocalProtocolError as exc:
                raise not_sent(exc, self.address) from None
            q: asyncio.Queue[_Item] = asyncio.Queue()
            self._pending[rid] = q
            self._writer.write(data)
            credit = asyncio.Event()
            feeding = asyncio.ensure_future(self._feed(rid, stdin, credit)) if stdin is not None else None
            answers = asyncio.ensure_future(self._channel_answers(rid, q, output, credit))
            try:
                if feeding is not None:
                    await asyncio.wait({answers, feeding}, return_when=asyncio.FIRST_COMPLETED)
                    if feeding.done():
                        feeding.result()  # what failed its input fails the channel: never dropped
                return await answers
            finally:
                await cancel_and_wait(answers)
                if feeding is not None:
                    await cancel_and_wait(feeding)
                del self._pending[rid]
                writer = self._writer
                if rid in self.conn.in_flight and writer is not None and not writer.is_closing():
                    writer.write(self.conn.cancel(rid))

    async def _channel_answers(
        self,
        rid: int,
        q: asyncio.Queue[_Item],
        output: Callable[[str, bytes], Awaitable[None]],
        credit: asyncio.Event,
    ) -> ChannelClosed:
        assert self._writer is not None
        while True:
            match await q.get():
                case ReplyReceived(message=ChannelOutput(stream=stream, data=data)):
                    await output(stream, data)
                    if data:  # empty: that output has ended (nothing to acknowledge)
                        self._writer.write(self.conn.channel_ack(rid, len(data)))
                case ReplyReceived(message=ChannelCredit()):
                    credit.set()
                case ReplyReceived(message=ChannelClosed() as closed):
                    return closed
                case RequestFailed(code=code, message=message):
                    raise ClientError(message, code)
                case _:
                    raise self._closed or ClientError("the connection closed")

    async def _feed(
        self, rid: int, stdin: AsyncIterator[bytes | ChannelResize], credit: asyncio.Event
    ) -> None:
        """Send `stdin` on channel `rid` within its window, then its end."""
        assert self._writer is not None
        async for data in stdin:
            if isinstance(data, ChannelResize):
                if rid in self.conn.in_flight:
                    self._writer.write(self.conn.channel_resize(rid, data.rows, data.cols))
                continue
            view = memoryview(data)
            while view:
                while not (room := self.conn.input_room(rid)):  # 0 too once the channel has ended
                    credit.clear()
                    await credit.wait()
                piece, view = view[:room], view[room:]
                self._writer.write(self.conn.channel_data(rid, bytes(piece)))
                await self._writer.drain()
        if rid in self.conn.in_flight:  # not once the channel has ended
            self._writer.write(self.conn.channel_end(rid))

    async def call(self, request: Request, reply_type: type[R]) -> R:
        """Send `request` and return its final reply, checked to be a `reply_type`."""
        last: Any = None
        async for last in self.stream(request):  # noqa: B007 - only the final reply matters
            pass
        if not isinstance(last, reply_type):
            raise ClientError(f"unexpected reply {type(last).__name__} to {type(request).__name__}")
        return last

    async def close(self) -> None:
        """Close the connection; a request still waiting for its reply fails with ClientError."""
        if self._reader_task is not None:
            await cancel_and_wait(self._reader_task)  # a cancellation of close() itself goes on
            self._reader_task = None
            if self._closed is None:
                self._fail_all(ClientError("the client closed this connection"))
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await self._writer.wait_closed()
            self._writer = None
