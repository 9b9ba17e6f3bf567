"""The handshake: authentication both ways, and everything a peer may get wrong before READY."""

import struct

import pytest

from protocol import (
    Authenticated,
    ClientConnection,
    ConnectionFailed,
    ErrorCode,
    ServerConnection,
    State,
)
from protocol.frames import FrameType, decode_frames

from .helpers import HELLO, NONCE, TOKENS, Pair, assert_server_failed, drain, fatal_error, raw_frame


def states(pair: Pair) -> tuple[State, State]:
    # A function call, so that mypy does not narrow the state property between assertions.
    return pair.client.state, pair.server.state


def test_handshake() -> None:
    pair = Pair(server_name="pool-1", max_frame_size=1 << 20, max_in_flight=8)
    assert states(pair) == (State.START, State.AWAIT_HELLO)
    assert pair.to_server(pair.client.start()) == []
    assert states(pair) == (State.AWAIT_CHALLENGE, State.AWAIT_AUTH)
    assert pair.to_client(pair.server.data_to_send()) == []
    assert states(pair) == (State.AWAIT_WELCOME, State.AWAIT_AUTH)
    assert pair.to_server(pair.client.data_to_send()) == [
        Authenticated("alice", "gpupool-python", 1 << 20, 8)
    ]
    assert pair.server.user == "alice"
    assert pair.to_client(pair.server.data_to_send()) == [Authenticated("alice", "pool-1", 1 << 20, 8)]
    assert states(pair) == (State.READY, State.READY)
    assert pair.server.data_to_send() == pair.client.data_to_send() == b""


def test_token_never_crosses_the_wire() -> None:
    pair = Pair()
    sent = pair.client.start()
    pair.to_server(sent)
    pair.to_client(pair.server.data_to_send())
    sent += pair.client.data_to_send()
    assert TOKENS["alice"] not in sent


def test_open_mode() -> None:
    pair = Pair(tokens=None, user="whoever", token=None).connect()
    assert pair.server.user == "whoever"


@pytest.mark.parametrize(("user", "token"), [("alice", b"wrong token"), ("mallory", b"any"), ("alice", None)])
def test_auth_failed(user: str, token: bytes | None) -> None:
    pair = Pair(user=user, token=token)
    pair.to_server(pair.client.start())
    pair.to_client(pair.server.data_to_send())
    pair.server.receive_data(pair.client.data_to_send())
    event = pair.server.next_event()
    assert isinstance(event, ConnectionFailed)
    assert event.code is ErrorCode.AUTH_FAILED
    assert pair.server.state is State.CLOSED
    error_bytes = pair.server.data_to_send()
    # Unknown user and wrong token must be indistinguishable on the wire.
    assert fatal_error(error_bytes).message.startswith("Authentication failed: the user is unknown or")
    assert pair.to_client(error_bytes) == [
        ConnectionFailed(ErrorCode.AUTH_FAILED, event.message, by_peer=True)
    ]
    assert pair.client.state is State.CLOSED


def test_unknown_user_and_wrong_token_send_identical_bytes() -> None:
    outputs = []
    for user, token in [("alice", b"wrong"), ("nobody", b"wrong")]:
        pair = Pair(user=user, token=token)
        pair.handshake()
        outputs.append(pair.server.data_to_send())
    assert outputs[0] == outputs[1]


def test_replayed_auth_is_rejected() -> None:
    first = Pair()
    hello = first.client.start()
    first.to_server(hello)
    first.to_client(first.server.data_to_send())
    auth = first.client.data_to_send()
    first.to_server(auth)
    assert first.server.state is State.READY

    # An eavesdropper replays both frames to a new connection: the server nonce is fresh.
    second = ServerConnection(TOKENS)
    second.receive_data(hello + auth)
    event = second.next_event()
    assert isinstance(event, ConnectionFailed)
    assert event.code is ErrorCode.AUTH_FAILED


CHALLENGE = raw_frame(FrameType.CHALLENGE, 0, {"version": 1, "server_nonce": NONCE})
WELCOME = {"user": "alice", "server": "evil", "max_frame_size": 1 << 20, "max_in_flight": 4}


@pytest.mark.parametrize("server_mac", [b"", b"x" * 32])
def test_client_rejects_server_without_the_token(server_mac: bytes) -> None:
    # An impostor pretending to be in open mode, or guessing a MAC.
    client = ClientConnection("alice", TOKENS["alice"])
    client.start()
    client.receive_data(CHALLENGE)
    assert drain(client) == []
    assert len(decode_frames(client.data_to_send())) == 1  # the AUTH
    client.receive_data(raw_frame(FrameType.WELCOME, 0, {**WELCOME, "server_mac": server_mac}))
    events = drain(client)
    assert len(events) == 1
    assert isinstance(events[0], ConnectionFailed)
    assert events[0].code is ErrorCode.AUTH_FAILED
    assert fatal_error(client.data_to_send()).code == ErrorCode.AUTH_FAILED


def test_server_rejects_unsupported_version() -> None:
    pair = Pair()
    events = pair.to_server(raw_frame(FrameType.HELLO, 0, {**HELLO, "versions": [2, 3]}))
    assert_server_failed(pair, events, ErrorCode.UNSUPPORTED_VERSION)


def test_client_rejects_a_version_it_did_not_offer() -> None:
    client = ClientConnection("alice", None)
    client.start()
    client.receive_data(raw_frame(FrameType.CHALLENGE, 0, {"version": 2, "server_nonce": NONCE}))
    events = drain(client)
    assert len(events) == 1
    assert isinstance(events[0], ConnectionFailed)
    assert events[0].code is ErrorCode.UNSUPPORTED_VERSION


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (raw_frame(FrameType.REQUEST, 1, {"op": "ping"}), ErrorCode.NOT_AUTHENTICATED),
        (raw_frame(FrameType.PING, 0, {}), ErrorCode.NOT_AUTHENTICATED),
        (raw_frame(FrameType.CANCEL, 1, {}), ErrorCode.NOT_AUTHENTICATED),
        (raw_frame(FrameType.AUTH, 0, {"mac": b""}), ErrorCode.UNEXPECTED_FRAME),
        (raw_frame(FrameType.WELCOME, 0, {}), ErrorCode.NOT_AUTHENTICATED),
        (raw_frame(FrameType.REPLY, 1, {"op": "pong", "server_time": 0.0}), ErrorCode.NOT_AUTHENTICATED),
    ],
)
def test_frames_before_hello(frame: bytes, code: ErrorCode) -> None:
    pair = Pair()
    assert_server_failed(pair, pair.to_server(frame), code)


def test_request_between_hello_and_auth() -> None:
    pair = Pair()
    pair.to_server(pair.client.start())
    pair.server.data_to_send()  # the CHALLENGE
    events = pair.to_server(raw_frame(FrameType.REQUEST, 1, {"op": "ping"}))
    assert_server_failed(pair, events, ErrorCode.NOT_AUTHENTICATED)


def test_second_hello() -> None:
    pair = Pair()
    hello = pair.client.start()
    pair.to_server(hello)
    pair.server.data_to_send()  # the CHALLENGE
    assert_server_failed(pair, pair.to_server(hello), ErrorCode.UNEXPECTED_FRAME)


def test_oversize_hello_rejected_from_header() -> None:
    # Before authentication the limit is small: 5000 bytes is too much, and the header is enough.
    pair = Pair()
    header = struct.pack(">2sBBBBII", b"GP", 1, FrameType.HELLO, 0, 0, 0, 5000)
    assert_server_failed(pair, pair.to_server(header), ErrorCode.FRAME_TOO_LARGE)


def test_oversize_frame_rejected_from_header() -> None:
    pair = Pair(max_frame_size=1 << 20).connect()
    header = struct.pack(">2sBBBBII", b"GP", 1, FrameType.REQUEST, 0, 0, 1, 2 * 1024**3)  # 2 GiB
    assert_server_failed(pair, pair.to_server(header), ErrorCode.FRAME_TOO_LARGE)
    assert pair.server._decoder.buffered == 0


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", ErrorCode.BAD_MAGIC),
        (b"\x16\x03\x01\x02\x00", ErrorCode.BAD_MAGIC),  # a TLS ClientHello on the plain port
        (struct.pack(">2sBBBBII", b"GP", 2, 1, 0, 0, 0, 0), ErrorCode.UNSUPPORTED_VERSION),
        (struct.pack(">2sBBBBII", b"GP", 1, 0x7F, 0, 0, 0, 0), ErrorCode.UNKNOWN_FRAME_TYPE),
        (raw_frame(FrameType.HELLO, 0, b"\xc1"), ErrorCode.BAD_PAYLOAD),
        (raw_frame(FrameType.HELLO, 0, {"versions": [1]}), ErrorCode.BAD_PAYLOAD),
    ],
)
def test_garbage_before_handshake(data: bytes, code: ErrorCode) -> None:
    pair = Pair()
    assert_server_failed(pair, pair.to_server(data), code)
