"""The client's side of a connection (the shared machinery is in connection.py)."""

from typing import cast

from protocol import auth
from protocol.channels import Channel
from protocol.codec import (
    ChannelInput,
    Message,
    Reply,
    Request,
    StreamItem,
    decode_message,
    encode_message,
    reply_type,
    stream_type,
)
from protocol.connection import EMPTY_PAYLOAD, Connection, Role, State
from protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from protocol.events import Authenticated, Event, ReplyReceived, RequestFailed
from protocol.frames import (
    DEFAULT_MAX_FRAME_SIZE,
    MAX_REQUEST_ID,
    PROTOCOL_VERSION,
    Frame,
    FrameType,
    encode_frame,
)
from protocol.messages import Auth, Challenge, ErrorMessage, Hello, Welcome
from protocol.requests import ChannelAck, ChannelData, ChannelEnd, ChannelResize, OpenChannel

__all__ = ["ClientConnection"]


class ClientConnection(Connection):
    """The client's side: ``start()``, then ``request()`` once Authenticated has been received.

    ``token`` None means the server is expected to be in open mode (no proof either way).
    """

    _ROLE = Role.CLIENT

    def __init__(
        self,
        user: str,
        token: bytes | None,
        *,
        client_name: str = "gpupool-python",
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    ) -> None:
        super().__init__(State.START, max_frame_size)
        self._user = user
        self._token = token
        self._client_name = client_name
        self._client_nonce = auth.new_nonce()
        self._server_nonce = b""
        self._max_in_flight = 1
        self._next_id = 1

    def start(self) -> bytes:
        """The HELLO frame that opens the connection."""
        hello = Hello([PROTOCOL_VERSION], self._user, self._client_nonce, self._client_name)
        return self._send(encode_message(hello), 0)

    def request(self, message: Request) -> tuple[int, bytes]:
        """Start a request; returns its id (to match replies) and the bytes to write."""
        if self._state is State.CLOSING:
            raise LocalProtocolError(
                ErrorCode.SHUTTING_DOWN, "The connection is closing; open a new one for new requests."
            )
        if self._state is not State.READY:
            raise LocalProtocolError(
                ErrorCode.NOT_AUTHENTICATED,
                f"Cannot send a request in state {self._state.name}; wait for the Authenticated event.",
            )
        if len(self._in_flight) >= self._max_in_flight:
            raise LocalProtocolError(
                ErrorCode.TOO_MANY_REQUESTS,
                f"The server allows {self._max_in_flight} requests in flight; wait for a reply first.",
            )
        request_id = self._allocate_id()
        data = self._send(encode_message(message), request_id)
        self._in_flight[request_id] = type(message)
        if isinstance(message, OpenChannel):
            self._channels[request_id] = Channel(message.stdin)
        return request_id, data

    def input_room(self, request_id: int) -> int:
        """How many bytes of ChannelData open channel ``request_id`` may be sent now (0 once its
        input has ended, or the channel has): wait for a ChannelCredit before sending more."""
        channel = self._channels.get(request_id)
        return channel.input_room if channel is not None else 0

    def channel_data(self, request_id: int, data: bytes) -> bytes:
        """Input for open channel ``request_id``: at most ``input_room`` bytes."""
        return self._channel_input(request_id, ChannelData(data))

    def channel_end(self, request_id: int) -> bytes:
        """The end of the channel's input (an exec's stdin EOF)."""
        return self._channel_input(request_id, ChannelEnd())

    def channel_resize(self, request_id: int, rows: int, cols: int) -> bytes:
        """The client's terminal is now ``rows`` x ``cols`` (an attach's window; 1 to 65535 each)."""
        return self._channel_input(request_id, ChannelResize(rows, cols))

    def channel_ack(self, request_id: int, size: int) -> bytes:
        """We have taken ``size`` bytes of the channel's output: the server may send as many more.
        b"" once the channel has ended (its output no longer counts)."""
        if request_id not in self._channels or self._state is State.CLOSED:
            return b""
        return self._channel_input(request_id, ChannelAck(size))

    def _channel_input(self, request_id: int, message: ChannelInput) -> bytes:
        channel = self._channels.get(request_id)
        if channel is None:
            raise LocalProtocolError(
                ErrorCode.UNEXPECTED_FRAME, f"Request {request_id} is not an open channel."
            )
        match message:
            case ChannelData(data=data):
                refusal = channel.add_input(len(data))
            case ChannelEnd():
                refusal = channel.end_input()
            case ChannelAck(size=size):
                refusal = channel.ack_output(size)
            case ChannelResize(rows=rows, cols=cols):
                refusal = channel.resize(rows, cols)
        if refusal is not None:
            raise LocalProtocolError(refusal[0], f"{refusal[1]}.")
        return self._send(encode_message(message), request_id)

    def cancel(self, request_id: int) -> bytes:
        """Ask the server to stop a request; it still ends with a final frame. b"" if not in flight."""
        if request_id not in self._in_flight or self._state is State.CLOSED:
            return b""
        return self._send((FrameType.CANCEL, EMPTY_PAYLOAD), request_id)

    def _allocate_id(self) -> int:
        # Ids wrap around after 2**32 - 1 requests, skipping 0 and any still in flight.
        while True:
            request_id = self._next_id
            self._next_id = request_id % MAX_REQUEST_ID + 1
            if request_id not in self._in_flight:
                return request_id

    def _handle(self, frame: Frame) -> Event | None:
        match frame.type:
            case FrameType.CHALLENGE:
                self._on_challenge(frame)
                return None
            case FrameType.WELCOME:
                return self._on_welcome(frame)
            case FrameType.REPLY | FrameType.STREAM | FrameType.ERROR:
                return self._on_answer(frame)
            case _:
                return super()._handle(frame)

    def _on_challenge(self, frame: Frame) -> None:
        challenge = decode_message(FrameType.CHALLENGE, frame.payload)
        assert isinstance(challenge, Challenge)
        if challenge.version != PROTOCOL_VERSION:
            raise RemoteProtocolError(
                ErrorCode.UNSUPPORTED_VERSION,
                f"The server chose protocol version {challenge.version}, which this client never offered.",
            )
        self._server_nonce = challenge.server_nonce
        mac = b""
        if self._token is not None:
            mac = auth.client_proof(self._token, self._server_nonce, self._client_nonce, self._user)
        frame_type, payload = encode_message(Auth(mac))
        self._queue(encode_frame(frame_type, 0, payload, max_frame_size=self._send_limit))

    def _on_welcome(self, frame: Frame) -> Authenticated:
        welcome = decode_message(FrameType.WELCOME, frame.payload)
        assert isinstance(welcome, Welcome)
        if self._token is not None:
            proof = (self._token, self._server_nonce, self._client_nonce, self._user, welcome.server_mac)
            if not auth.check_server_proof(*proof):
                raise RemoteProtocolError(
                    ErrorCode.AUTH_FAILED,
                    "The server could not prove it knows your token; check that this is the right server.",
                )
        self._send_limit = welcome.max_frame_size
        self._max_in_flight = welcome.max_in_flight
        self._decoder.max_frame_size = self._max_frame_size
        return Authenticated(welcome.user, welcome.server, welcome.max_frame_size, welcome.max_in_flight)

    def _on_answer(self, frame: Frame) -> Event:
        request_class = self._in_flight.get(frame.request_id)
        if request_class is None:
            raise RemoteProtocolError(
                ErrorCode.UNEXPECTED_FRAME,
                f"A {frame.type.name} frame arrived for request {frame.request_id}, which is not in flight.",
            )
        message = decode_message(frame.type, frame.payload)
        if isinstance(message, ErrorMessage):
            self._finish(frame.request_id)
            return RequestFailed(frame.request_id, ErrorCode.coerce(message.code), message.message)
        final = frame.type is FrameType.REPLY
        expected = (reply_type(request_class),) if final else stream_type(request_class)
        if type(message) not in expected:
            raise RemoteProtocolError(
                ErrorCode.BAD_PAYLOAD,
                f"Request {frame.request_id} ({request_class.OP}) got a {type(message).__name__} in answer.",
            )
        self._count(frame.request_id, message)
        if final:
            self._finish(frame.request_id)
        # The type check above proved it is the reply or stream class of this request.
        return ReplyReceived(frame.request_id, cast(Reply | StreamItem, message), final)

    def _count(self, request_id: int, message: Message) -> None:
        """A channel's output and credit, held to its window: a server that sends past it breaks
        the protocol."""
        channel = self._channels.get(request_id)
        if channel is not None and (refusal := channel.count_stream_item(message)) is not None:
            code, problem = refusal
            raise RemoteProtocolError(
                code, f"{problem} (request {request_id}); the server breaks the protocol."
            )

    def _finish(self, request_id: int) -> None:
        del self._in_flight[request_id]
        self._channels.pop(request_id, None)
