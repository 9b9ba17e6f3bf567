"""The server's side of one client connection (the shared machinery is in connection.py)."""

from collections.abc import Mapping
from typing import Any, cast

from protocol import auth
from protocol.channels import Channel
from protocol.codec import (
    Message,
    Reply,
    Request,
    StreamItem,
    decode_message,
    encode_message,
    reply_type,
    stream_type,
)
from protocol.connection import DEFAULT_MAX_IN_FLIGHT, Connection, Role, State, error_frame
from protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from protocol.events import (
    NEED_DATA,
    Authenticated,
    CancelRequested,
    ChannelAcked,
    ChannelDataReceived,
    ChannelEndReceived,
    ChannelResized,
    DecodeNeeded,
    Event,
    NeedData,
    RequestReceived,
)
from protocol.frames import (
    DEFAULT_MAX_FRAME_SIZE,
    PROTOCOL_VERSION,
    Frame,
    FrameType,
    encode_frame,
    unpack_payload,
)
from protocol.messages import Auth, Challenge, ErrorMessage, Hello, Welcome
from protocol.replies import ChannelCredit
from protocol.requests import ChannelAck, ChannelData, ChannelEnd, ChannelResize, OpenChannel

__all__ = ["ServerConnection"]


class ServerConnection(Connection):
    """The server's side of one client connection.

    ``tokens`` maps user → token, or is None for open mode (loopback only, no tokens).
    A request payload larger than ``decode_inline`` bytes is not decoded here but handed out as
    DecodeNeeded, to be decoded elsewhere and given back with ``decoded`` (None: all here).
    """

    _ROLE = Role.SERVER

    def __init__(
        self,
        tokens: Mapping[str, bytes] | None,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        server_name: str = "gpupool",
        decode_inline: int | None = None,
    ) -> None:
        super().__init__(State.AWAIT_HELLO, max_frame_size)
        self._decode_inline = decode_inline
        self._decoding: int | None = None  # the request id of a DecodeNeeded not yet given back
        self._authenticator = auth.Authenticator(tokens)
        self._max_in_flight = max_in_flight
        self._server_name = server_name
        self._hello: Hello | None = None
        self._server_nonce = b""
        self._cancelled: set[int] = set()
        self._user: str | None = None

    @property
    def user(self) -> str | None:
        """The authenticated user name; None until the handshake is done."""
        return self._user

    @property
    def claimed_user(self) -> str | None:
        """The user name HELLO gave, authenticated or not (what a failed handshake tried to be, for
        the server to throttle); None before a HELLO."""
        return self._hello.user if self._hello is not None else None

    def reply(self, request_id: int, message: Reply) -> bytes:
        """Finish request ``request_id`` with its reply (b"" if the connection is closed)."""
        if self._state is State.CLOSED:
            return b""
        self._check_answer(request_id, message, (reply_type(self._request_class(request_id)),))
        data = self._send(encode_message(message), request_id)
        self._finish(request_id)
        return data

    def stream(self, request_id: int, message: StreamItem) -> bytes:
        """Send one non-final item of a streaming reply (b"" if the connection is closed)."""
        if self._state is State.CLOSED:
            return b""
        self._check_answer(request_id, message, stream_type(self._request_class(request_id)))
        channel = self._channels.get(request_id)
        if channel is not None and (refusal := channel.count_stream_item(message)) is not None:
            raise LocalProtocolError(*refusal)
        return self._send(encode_message(message), request_id)

    def output_room(self, request_id: int) -> int:
        """How many bytes of ChannelOutput open channel ``request_id`` may be sent now (0 once it
        has ended): send no more until a ChannelAcked event makes room."""
        channel = self._channels.get(request_id)
        return channel.output_room if channel is not None else 0

    def credit(self, request_id: int, size: int) -> bytes:
        """The far end of channel ``request_id`` has taken ``size`` bytes of its input: the
        ChannelCredit that lets the client send as many again (b"" once it has ended)."""
        if self._state is State.CLOSED or request_id not in self._channels:
            return b""
        return self.stream(request_id, ChannelCredit(size))

    def error(self, request_id: int, code: ErrorCode, message: str) -> bytes:
        """Finish request ``request_id`` with an error; the connection stays open."""
        if self._state is State.CLOSED:
            return b""
        self._request_class(request_id)
        data = self._send(encode_message(ErrorMessage(int(code), message)), request_id)
        self._finish(request_id)
        return data

    def _request_class(self, request_id: int) -> type[Any]:
        cls = self._in_flight.get(request_id)
        if cls is None:
            raise LocalProtocolError(
                ErrorCode.UNEXPECTED_FRAME, f"Request {request_id} is not in flight; it was finished already."
            )
        return cls

    @staticmethod
    def _check_answer(request_id: int, message: Message, expected: tuple[type[Any], ...]) -> None:
        if type(message) not in expected:
            names = " or ".join(cls.__name__ for cls in expected) or "no stream item"
            raise LocalProtocolError(
                ErrorCode.BAD_PAYLOAD,
                f"Request {request_id} cannot be answered with {type(message).__name__} (expected {names}).",
            )

    def _finish(self, request_id: int) -> None:
        del self._in_flight[request_id]
        self._channels.pop(request_id, None)
        self._cancelled.discard(request_id)

    def _handle(self, frame: Frame) -> Event | None:
        match frame.type:
            case FrameType.HELLO:
                self._on_hello(frame)
                return None
            case FrameType.AUTH:
                return self._on_auth(frame)
            case FrameType.REQUEST:
                return self._on_request(frame)
            case FrameType.CANCEL:
                unpack_payload(frame.payload)
                # A CANCEL for a finished request crossed our reply on the wire: not an error.
                if frame.request_id not in self._in_flight or frame.request_id in self._cancelled:
                    return None
                self._cancelled.add(frame.request_id)
                return CancelRequested(frame.request_id)
            case FrameType.CHANNEL:
                return self._on_channel(frame)
            case _:
                return super()._handle(frame)

    def _on_channel(self, frame: Frame) -> Event | None:
        """Input on an open channel, within its window. A frame for a request that has finished
        crossed its final answer on the wire: dropped, as a late CANCEL is (it costs nothing to
        keep). One for a request in flight that is no channel breaks the protocol."""
        rid = frame.request_id
        message = decode_message(FrameType.CHANNEL, frame.payload)
        channel = self._channels.get(rid)
        if channel is None:
            if rid in self._in_flight:
                raise RemoteProtocolError(
                    ErrorCode.UNEXPECTED_FRAME,
                    f"A CHANNEL frame for request {rid}, which is not a channel; only an "
                    "open_channel request takes channel input.",
                )
            return None
        event: Event
        match message:
            case ChannelData(data=data):
                refusal, event = channel.add_input(len(data)), ChannelDataReceived(rid, data)
            case ChannelEnd():
                refusal, event = channel.end_input(), ChannelEndReceived(rid)
            case ChannelAck(size=size):
                refusal, event = channel.ack_output(size), ChannelAcked(rid, size)
            case ChannelResize(rows=rows, cols=cols):
                refusal, event = channel.resize(rows, cols), ChannelResized(rid, rows, cols)
            case _:
                raise AssertionError(f"{type(message).__name__} is not channel input")
        if refusal is not None:
            code, problem = refusal
            raise RemoteProtocolError(code, f"{problem} (request {rid}); the client breaks the protocol.")
        return event

    def _on_hello(self, frame: Frame) -> None:
        hello = decode_message(FrameType.HELLO, frame.payload)
        assert isinstance(hello, Hello)
        if PROTOCOL_VERSION not in hello.versions:
            raise RemoteProtocolError(
                ErrorCode.UNSUPPORTED_VERSION,
                f"The client speaks protocol versions {hello.versions[:8]} but this server speaks "
                f"[{PROTOCOL_VERSION}]; install a matching poolctl.",
            )
        self._hello = hello
        self._server_nonce = auth.new_nonce()
        self._queue(self._encode(Challenge(PROTOCOL_VERSION, self._server_nonce)))

    def _on_auth(self, frame: Frame) -> Authenticated:
        message = decode_message(FrameType.AUTH, frame.payload)
        assert isinstance(message, Auth)
        assert self._hello is not None
        hello = self._hello
        server_mac = self._authenticator.verify(
            hello.user, self._server_nonce, hello.client_nonce, message.mac
        )
        self._user = hello.user
        welcome = Welcome(
            hello.user, self._server_name, self._max_frame_size, self._max_in_flight, server_mac
        )
        self._queue(self._encode(welcome))
        # Only now may the client send full-size frames, and we full-size replies.
        self._decoder.max_frame_size = self._max_frame_size
        self._send_limit = self._max_frame_size
        return Authenticated(hello.user, hello.client, self._max_frame_size, self._max_in_flight)

    def _on_request(self, frame: Frame) -> RequestReceived | DecodeNeeded | None:
        request_id = frame.request_id
        if request_id in self._in_flight:
            raise RemoteProtocolError(
                ErrorCode.DUPLICATE_REQUEST_ID,
                f"Request id {request_id} is already in flight; use a new id for each request.",
            )
        if len(self._in_flight) >= self._max_in_flight:
            raise RemoteProtocolError(
                ErrorCode.TOO_MANY_REQUESTS,
                f"More than {self._max_in_flight} requests in flight; wait for replies before sending more.",
            )
        if self._decode_inline is not None and len(frame.payload) > self._decode_inline:
            self._decoding = request_id
            return DecodeNeeded(request_id, frame.payload)
        return self._accept(request_id, decode_message(FrameType.REQUEST, frame.payload))

    def next_event(self) -> Event | NeedData:
        if self._decoding is not None:
            raise LocalProtocolError(
                ErrorCode.UNEXPECTED_FRAME,
                f"Request {self._decoding} waits to be decoded: give it to decoded() first.",
            )
        return super().next_event()

    def decoded(self, request_id: int, result: Message | RemoteProtocolError) -> Event | NeedData:
        """The decoded message of a DecodeNeeded (or the error decoding it raised): the event it
        makes, as ``next_event`` would have returned it; NEED_DATA when it makes none (the
        connection is closing: an error for it waits in ``data_to_send()``)."""
        if request_id != self._decoding:
            raise LocalProtocolError(
                ErrorCode.UNEXPECTED_FRAME, f"Request {request_id} was not being decoded."
            )
        self._decoding = None
        if self._state is State.CLOSED:
            return self.next_event()
        try:
            if isinstance(result, RemoteProtocolError):
                raise result
            event = self._accept(request_id, result)
        except RemoteProtocolError as exc:
            return self._fail(exc)
        return event if event is not None else NEED_DATA

    def _accept(self, request_id: int, message: Message) -> RequestReceived | None:
        if self._state is State.CLOSING:
            self._queue(
                error_frame(
                    request_id,
                    ErrorCode.SHUTTING_DOWN,
                    "The server is shutting down; retry on a new connection.",
                )
            )
            return None
        self._in_flight[request_id] = type(message)
        if isinstance(message, OpenChannel):
            self._channels[request_id] = Channel(message.stdin)
        # decode_message(REQUEST, ...) only ever builds request classes.
        return RequestReceived(request_id, cast(Request, message))

    def _unexpected(self, frame: Frame) -> RemoteProtocolError:
        if self._state in {State.AWAIT_HELLO, State.AWAIT_AUTH} and frame.type not in {
            FrameType.HELLO,
            FrameType.AUTH,
        }:
            return RemoteProtocolError(
                ErrorCode.NOT_AUTHENTICATED,
                f"A {frame.type.name} frame arrived before authentication; send HELLO and AUTH first.",
            )
        return super()._unexpected(frame)

    def _encode(self, message: Message) -> bytes:
        frame_type, payload = encode_message(message)
        return encode_frame(frame_type, 0, payload, max_frame_size=self._send_limit)
