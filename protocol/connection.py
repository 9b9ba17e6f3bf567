"""The connection state machine both sides share, in the sans-IO style of h11.

Theory of operation
-------------------
A connection never touches a socket. Its owner feeds it received bytes with ``receive_data`` (``b""``
means end of input) and pulls events with ``next_event`` until it gets :data:`NEED_DATA`. Methods the
owner calls to send (``start``, ``request``, ``reply``, ...) return the bytes to write. Bytes the
connection decides to send by itself while handling input (CHALLENGE, AUTH and WELCOME during the
handshake, PONG, ERROR frames) accumulate in ``data_to_send()``, which the owner drains and writes
after every ``next_event``.

Every frame received or sent must be allowed by :data:`TRANSITIONS` below for the side, its current
state and the direction; the table also gives the state that follows. The handshake is::

    client START --HELLO--> AWAIT_CHALLENGE --CHALLENGE--> AWAIT_WELCOME --WELCOME--> READY
    server AWAIT_HELLO --HELLO--> AWAIT_AUTH --AUTH--> READY

GOODBYE (either way) leads to CLOSING: no new requests, in-flight ones finish. Three rules hold in
every state and are not repeated in the table:

* an ERROR frame with request id 0, in either direction, ends the connection: CLOSED;
* a frame the table does not allow, or any malformed input, is the peer's protocol violation: we
  queue an ERROR frame (request id 0, code, sentence), emit ConnectionFailed and go to CLOSED;
* end of input goes to CLOSED.

Once CLOSED a connection ignores input and ``next_event`` returns ConnectionClosed.

Timeouts are the owner's job: while ``state`` is before READY it applies the handshake timeout, once
READY with nothing ``in_flight`` the idle timeout, and either ends with ``abort(code, message)``.
"""

from enum import Enum
from typing import Any, ClassVar, Final

from protocol.channels import Channel
from protocol.codec import decode_message, encode_message
from protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from protocol.events import (
    NEED_DATA,
    ConnectionClosed,
    ConnectionFailed,
    Event,
    GoodbyeReceived,
    NeedData,
    PongReceived,
)
from protocol.frames import (
    HANDSHAKE_MAX_FRAME_SIZE,
    Frame,
    FrameDecoder,
    FrameType,
    encode_frame,
    pack_payload,
    unpack_payload,
)
from protocol.messages import ErrorMessage, Goodbye

__all__ = [
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_IN_FLIGHT",
    "TRANSITIONS",
    "Connection",
    "Direction",
    "Role",
    "State",
]

DEFAULT_MAX_IN_FLIGHT: Final = 64
DEFAULT_HANDSHAKE_TIMEOUT: Final = 10.0  # seconds from accept to WELCOME, enforced by the daemon
DEFAULT_IDLE_TIMEOUT: Final = 300.0  # seconds READY with nothing in flight, enforced by the daemon
EMPTY_PAYLOAD: Final = pack_payload({})  # the payload of CANCEL, PING and PONG
_MAX_MESSAGE: Final = 500  # characters of an error sentence we send: an ERROR fits any frame limit


class State(Enum):
    """Where a connection is in its life.

    START, AWAIT_CHALLENGE and AWAIT_WELCOME are client states; AWAIT_HELLO and AWAIT_AUTH server
    states; READY, CLOSING (GOODBYE sent or received) and CLOSED are shared.
    """

    START = "START"
    AWAIT_HELLO = "AWAIT_HELLO"
    AWAIT_CHALLENGE = "AWAIT_CHALLENGE"
    AWAIT_AUTH = "AWAIT_AUTH"
    AWAIT_WELCOME = "AWAIT_WELCOME"
    READY = "READY"
    CLOSING = "CLOSING"
    CLOSED = "CLOSED"


class Role(Enum):
    """Which side of the connection this state machine plays."""

    CLIENT = "client"
    SERVER = "server"


class Direction(Enum):
    """Whether a frame is received from the peer or sent by the owner."""

    RECEIVE = "receive"
    SEND = "send"


def _stay(state: State, *frame_types: FrameType) -> dict[FrameType, State]:
    return dict.fromkeys(frame_types, state)


_T, _S, _C, _IN, _OUT = FrameType, Role.SERVER, Role.CLIENT, Direction.RECEIVE, Direction.SEND
_WAIT_HELLO, _WAIT_AUTH, _READY, _CLOSING = State.AWAIT_HELLO, State.AWAIT_AUTH, State.READY, State.CLOSING

# THE table: (side, state, direction) -> {frame type allowed: state afterwards}. Anything missing is
# illegal. Frames the connection answers by itself are noted; owners send with the public methods.
TRANSITIONS: Final[dict[tuple[Role, State, Direction], dict[FrameType, State]]] = {
    # -- server ----------------------------------------------------------------------------------------
    (_S, _WAIT_HELLO, _IN): {_T.HELLO: _WAIT_AUTH},  # answered with CHALLENGE
    (_S, _WAIT_AUTH, _IN): {_T.AUTH: _READY},  # answered with WELCOME, or fatal AUTH_FAILED
    (_S, _READY, _IN): {
        **_stay(_READY, _T.REQUEST, _T.CANCEL, _T.CHANNEL, _T.PING, _T.PONG),
        _T.GOODBYE: _CLOSING,
    },
    (_S, _READY, _OUT): {**_stay(_READY, _T.REPLY, _T.STREAM, _T.ERROR, _T.PING), _T.GOODBYE: _CLOSING},
    # A REQUEST that crossed our GOODBYE on the wire is answered SHUTTING_DOWN, not a violation.
    (_S, _CLOSING, _IN): _stay(_CLOSING, _T.REQUEST, _T.CANCEL, _T.CHANNEL, _T.PING, _T.PONG, _T.GOODBYE),
    (_S, _CLOSING, _OUT): _stay(_CLOSING, _T.REPLY, _T.STREAM, _T.ERROR, _T.PING, _T.GOODBYE),
    # -- client ----------------------------------------------------------------------------------------
    (_C, State.START, _OUT): {_T.HELLO: State.AWAIT_CHALLENGE},
    (_C, State.AWAIT_CHALLENGE, _IN): {_T.CHALLENGE: State.AWAIT_WELCOME},  # answered with AUTH
    (_C, State.AWAIT_WELCOME, _IN): {_T.WELCOME: _READY},
    (_C, _READY, _IN): {
        **_stay(_READY, _T.REPLY, _T.STREAM, _T.ERROR, _T.PING, _T.PONG),
        _T.GOODBYE: _CLOSING,
    },
    (_C, _READY, _OUT): {**_stay(_READY, _T.REQUEST, _T.CANCEL, _T.CHANNEL, _T.PING), _T.GOODBYE: _CLOSING},
    (_C, _CLOSING, _IN): _stay(_CLOSING, _T.REPLY, _T.STREAM, _T.ERROR, _T.PING, _T.PONG, _T.GOODBYE),
    (_C, _CLOSING, _OUT): _stay(_CLOSING, _T.CANCEL, _T.CHANNEL, _T.PING, _T.GOODBYE),  # no new requests
}


class Connection:
    """What both sides share: input handling, the table, in-flight tracking, shutdown."""

    _ROLE: ClassVar[Role]

    def __init__(self, state: State, max_frame_size: int) -> None:
        self._state = state
        self._max_frame_size = max_frame_size  # what we accept once authenticated
        self._send_limit = HANDSHAKE_MAX_FRAME_SIZE  # what the peer accepts; raised at WELCOME
        self._decoder = FrameDecoder(HANDSHAKE_MAX_FRAME_SIZE)
        self._outbox = bytearray()
        self._in_flight: dict[int, type[Any]] = {}  # request id -> request class
        self._channels: dict[int, Channel] = {}  # request id of an open channel -> its flow control
        self._eof = False

    @property
    def state(self) -> State:
        """The current state (see TRANSITIONS)."""
        return self._state

    @property
    def in_flight(self) -> frozenset[int]:
        """Request ids sent or received that have not had their final REPLY or ERROR yet."""
        return frozenset(self._in_flight)

    @property
    def buffered(self) -> int:
        """Bytes received that do not form a whole frame yet (at most a header and one maximal
        frame): what a server adds up across connections to bound their memory."""
        return self._decoder.buffered

    def receive_data(self, data: bytes) -> None:
        """Feed bytes read from the transport; ``b""`` means the peer closed its side."""
        if self._state is State.CLOSED:
            return
        if data:
            self._decoder.receive_data(data)
        else:
            self._eof = True

    def next_event(self) -> Event | NeedData:
        """Process buffered input and return the next event, or NEED_DATA."""
        while True:
            if self._state is State.CLOSED:
                return ConnectionClosed()
            try:
                frame = self._decoder.next_frame()
                if frame is None:
                    if not self._eof:
                        return NEED_DATA
                    self._close()
                    return ConnectionClosed()
                event = self._receive(frame)
            except RemoteProtocolError as exc:
                return self._fail(exc)
            if event is not None:
                return event

    def data_to_send(self) -> bytes:
        """Bytes the connection produced on its own (handshake, PONG, ERROR); write them out."""
        data = bytes(self._outbox)
        self._outbox.clear()
        return data

    def goodbye(self, reason: str) -> bytes:
        """Announce that we start no new requests; in-flight ones may still finish."""
        return self._send(encode_message(Goodbye(reason)), 0)

    def ping(self, value: int = 0) -> bytes:
        """A transport-level PING; the peer answers PONG with ``value`` (PongReceived)."""
        return self._send((_T.PING, EMPTY_PAYLOAD), value)

    def abort(self, code: ErrorCode, message: str) -> bytes:
        """End the connection with a fatal ERROR frame (e.g. a timeout); returns its bytes."""
        if self._state is State.CLOSED:
            return b""
        self._close()
        return error_frame(0, code, message)

    # -- receiving ---------------------------------------------------------------------------------

    def _receive(self, frame: Frame) -> Event | None:
        if frame.type not in _MAY_BE_LARGE and len(frame.payload) > HANDSHAKE_MAX_FRAME_SIZE:
            raise RemoteProtocolError(
                ErrorCode.FRAME_TOO_LARGE,
                f"A {frame.type.name} frame of {len(frame.payload)} bytes; only requests and replies "
                f"may carry more than {HANDSHAKE_MAX_FRAME_SIZE}.",
            )
        if frame.type is _T.ERROR and frame.request_id == 0:
            error = decode_message(_T.ERROR, frame.payload)
            assert isinstance(error, ErrorMessage)
            self._close()
            return ConnectionFailed(ErrorCode.coerce(error.code), error.message, by_peer=True)
        next_state = TRANSITIONS.get((self._ROLE, self._state, _IN), {}).get(frame.type)
        if next_state is None:
            raise self._unexpected(frame)
        event = self._handle(frame)
        self._state = next_state
        return event

    def _handle(self, frame: Frame) -> Event | None:
        """Act on a frame the table allows; subclasses handle their own types first."""
        match frame.type:
            case _T.PING:
                unpack_payload(frame.payload)
                self._queue(encode_frame(_T.PONG, frame.request_id, EMPTY_PAYLOAD))
                return None
            case _T.PONG:
                unpack_payload(frame.payload)
                return PongReceived(frame.request_id)
            case _T.GOODBYE:
                goodbye = decode_message(_T.GOODBYE, frame.payload)
                assert isinstance(goodbye, Goodbye)
                return GoodbyeReceived(goodbye.reason)
            case _:
                raise AssertionError(f"{frame.type.name} is in the table but has no handler")

    def _unexpected(self, frame: Frame) -> RemoteProtocolError:
        peer = "server" if self._ROLE is Role.CLIENT else "client"
        return RemoteProtocolError(
            ErrorCode.UNEXPECTED_FRAME,
            f"A {frame.type.name} frame is not allowed from the {peer} in state "
            f"{self._state.name}; the peer does not follow the gpupool protocol.",
        )

    def _fail(self, exc: RemoteProtocolError) -> ConnectionFailed:
        """The peer broke the protocol: tell it why, close, and report it."""
        self._queue(error_frame(0, exc.code, exc.message))
        self._close()
        return ConnectionFailed(exc.code, exc.message, by_peer=False)

    def _close(self) -> None:
        self._state = State.CLOSED
        self._in_flight.clear()
        self._channels.clear()
        self._decoder = FrameDecoder(0)  # drop buffered input; nothing more will be read

    def _queue(self, data: bytes) -> None:
        self._outbox += data

    # -- sending -------------------------------------------------------------------------------------

    def _send(self, encoded: tuple[FrameType, bytes], request_id: int) -> bytes:
        """Check the send table, encode against the peer's limit, then move to the next state."""
        frame_type, payload = encoded
        next_state = TRANSITIONS.get((self._ROLE, self._state, _OUT), {}).get(frame_type)
        if next_state is None:
            raise LocalProtocolError(
                ErrorCode.UNEXPECTED_FRAME,
                f"Cannot send a {frame_type.name} frame in state {self._state.name}.",
            )
        data = encode_frame(frame_type, request_id, payload, max_frame_size=self._send_limit)
        self._state = next_state
        return data


# The frames whose payload may be as large as the frame limit (a channel's data is bounded by its
# window besides); every other one (control frames,
# errors) is small, and a large one is refused from its size before it is decoded.
_MAY_BE_LARGE = frozenset({_T.REQUEST, _T.REPLY, _T.STREAM, _T.CHANNEL})


def error_frame(request_id: int, code: ErrorCode, message: str) -> bytes:
    """An ERROR frame; it bypasses the table because it must go out in any state."""
    payload = encode_message(ErrorMessage(int(code), message[:_MAX_MESSAGE]))[1]
    return encode_frame(_T.ERROR, request_id, payload, max_frame_size=HANDSHAKE_MAX_FRAME_SIZE)
