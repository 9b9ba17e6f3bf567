"""A connected client/server pair that shuttles bytes by hand (after h11's tests/helpers.py)."""

from collections.abc import Mapping, Sequence
from typing import Any

from protocol import (
    NEED_DATA,
    Authenticated,
    ClientConnection,
    ConnectionClosed,
    ConnectionFailed,
    ErrorCode,
    Event,
    Request,
    RequestReceived,
    ServerConnection,
    State,
)
from protocol.codec import decode_message
from protocol.frames import FrameType, decode_frames, encode_frame, pack_payload
from protocol.messages import ErrorMessage
from protocol.record import Record

TOKENS: Mapping[str, bytes] = {"alice": b"alice-secret-token-0123456789abc", "bob": b"bob-secret-token"}

# Far more events than any test input can produce: reaching it means next_event never said NEED_DATA.
MAX_EVENTS = 100_000


def is_record(obj: object) -> bool:
    """A message, event or frame class (a Record subclass)."""
    return isinstance(obj, type) and issubclass(obj, Record) and obj is not Record


def drain(connection: ClientConnection | ServerConnection) -> list[Event]:
    """Every event until NEED_DATA or the connection's end; fails if that never comes."""
    events: list[Event] = []
    for _ in range(MAX_EVENTS):
        event = connection.next_event()
        if event is NEED_DATA:
            return events
        events.append(event)
        if isinstance(event, ConnectionClosed | ConnectionFailed):
            return events
    raise AssertionError("next_event never returned NEED_DATA")


def raw_frame(frame_type: FrameType, request_id: int, payload: Mapping[str, Any] | bytes) -> bytes:
    """A frame built without any of the connection's checks, for feeding illegal input."""
    body = payload if isinstance(payload, bytes) else pack_payload(payload)
    return encode_frame(frame_type, request_id, body, max_frame_size=1 << 32)


class Pair:
    """A client and a server connected by the test: ``to_server``/``to_client`` deliver bytes."""

    def __init__(
        self,
        tokens: Mapping[str, bytes] | None = TOKENS,
        user: str = "alice",
        token: bytes | None = TOKENS["alice"],
        **server_options: Any,
    ) -> None:
        self.client = ClientConnection(user, token)
        self.server = ServerConnection(tokens, **server_options)

    def to_server(self, data: bytes) -> list[Event]:
        self.server.receive_data(data)
        return drain(self.server)

    def to_client(self, data: bytes) -> list[Event]:
        self.client.receive_data(data)
        return drain(self.client)

    def handshake(self) -> tuple[list[Event], list[Event]]:
        """Run HELLO → CHALLENGE → AUTH → WELCOME; return (server events, client events)."""
        assert self.to_server(self.client.start()) == []
        assert self.to_client(self.server.data_to_send()) == []
        server_events = self.to_server(self.client.data_to_send())
        client_events = self.to_client(self.server.data_to_send())
        return server_events, client_events

    def connect(self) -> "Pair":
        """Handshake and assert it succeeded."""
        server_events, client_events = self.handshake()
        assert len(server_events) == 1
        assert isinstance(server_events[0], Authenticated)
        assert len(client_events) == 1
        assert isinstance(client_events[0], Authenticated)
        return self

    def request(self, message: Request) -> int:
        """Send a request and check that the server received exactly it."""
        request_id, data = self.client.request(message)
        assert self.to_server(data) == [RequestReceived(request_id, message)]
        return request_id


NONCE = b"N" * 32
HELLO = {"versions": [1], "user": "alice", "client_nonce": NONCE, "client": "test"}


def fatal_error(data: bytes) -> ErrorMessage:
    """The single connection-level ERROR frame in ``data``."""
    frames = decode_frames(data)
    assert len(frames) == 1
    assert frames[0].type is FrameType.ERROR
    assert frames[0].request_id == 0
    message = decode_message(FrameType.ERROR, frames[0].payload)
    assert isinstance(message, ErrorMessage)
    return message


def assert_server_failed(pair: Pair, events: Sequence[Event], code: ErrorCode) -> None:
    """The server reported ``code``, closed, and queued the ERROR frame telling the client why."""
    assert len(events) == 1
    event = events[0]
    assert isinstance(event, ConnectionFailed)
    assert (event.code, event.by_peer) == (code, False)
    assert pair.server.state is State.CLOSED
    error = fatal_error(pair.server.data_to_send())
    assert error.code == code
    assert error.message == event.message
    assert error.message.endswith(".")
