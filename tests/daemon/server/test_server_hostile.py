"""Every byte a client sends is hostile until it is authenticated (docs/DESIGN.md §7, §9): malformed,
oversized, replayed, slow and random input each gets an error frame and a close, and a well-behaved
client connected at the same time is unaffected. Runs against a real `poold` process."""

from __future__ import annotations

import contextlib
import secrets
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.queue.embedded_redis import EmbeddedRedis
from protocol import (
    NEED_DATA,
    Authenticated,
    ClientConnection,
    ConnectionClosed,
    ConnectionFailed,
    Enqueue,
    Enqueued,
    ErrorCode,
    Ping,
    Pong,
    ReplyReceived,
    Request,
    Waited,
    WaitJobs,
)
from protocol.frames import HEADER, FrameDecoder, FrameType, encode_frame, pack_payload, unpack_payload
from tests.support.poold_proc import poold

TOKENS = {"alice": secrets.token_urlsafe(24), "bob": secrets.token_urlsafe(24)}
HANDSHAKE_TIMEOUT = 0.5


@pytest.fixture
def server(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[str]:
    with poold(
        redis_server, tmp_path, TOKENS, "--handshake-timeout", str(HANDSHAKE_TIMEOUT), "--idle-timeout", "1"
    ) as address:
        yield address


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def read_until_closed(
    sock: socket.socket, limit: float = 10
) -> list[tuple[FrameType, int, dict[str, object]]]:
    """Every frame the server sends until it closes the connection (which it must, within `limit`)."""
    decoder = FrameDecoder(16 * 1024 * 1024)
    frames: list[tuple[FrameType, int, dict[str, object]]] = []
    deadline = time.monotonic() + limit
    sock.settimeout(limit)
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            data = b""
        if time.monotonic() > deadline:
            raise AssertionError("the server did not close the connection")
        if not data:
            return frames
        decoder.receive_data(data)
        while (frame := decoder.next_frame()) is not None:
            frames.append((frame.type, frame.request_id, unpack_payload(frame.payload)))


def fatal_error(frames: list[tuple[FrameType, int, dict[str, object]]]) -> int:
    errors = [(rid, body) for kind, rid, body in frames if kind is FrameType.ERROR]
    assert errors, f"no ERROR frame before the close: {frames}"
    rid, body = errors[-1]
    assert rid == 0
    assert isinstance(body["message"], str)
    assert body["message"]
    code = body["code"]
    assert isinstance(code, int)
    return code


def authenticate(sock: socket.socket, user: str = "alice", token: str | None = None) -> ClientConnection:
    conn = ClientConnection(user, (token or TOKENS[user]).encode())
    sock.sendall(conn.start())
    while True:
        conn.receive_data(sock.recv(65536))
        while (event := conn.next_event()) is not NEED_DATA:
            sock.sendall(conn.data_to_send())
            if isinstance(event, Authenticated):
                return conn
            raise AssertionError(f"handshake failed: {event}")
        sock.sendall(conn.data_to_send())


def ping_works(address: str) -> bool:
    with connect(address) as sock:
        conn = authenticate(sock)
        _, data = conn.request(Ping())
        sock.sendall(data)
        while True:
            conn.receive_data(sock.recv(65536))
            event = conn.next_event()
            if event is not NEED_DATA:
                return isinstance(event, ReplyReceived) and isinstance(event.message, Pong)


def test_request_before_hello_is_refused(server: str) -> None:
    with connect(server) as sock:
        sock.sendall(encode_frame(FrameType.REQUEST, 1, pack_payload({"op": "ping"})))
        assert fatal_error(read_until_closed(sock)) == ErrorCode.NOT_AUTHENTICATED
    assert ping_works(server)


def test_oversized_hello_is_refused_from_its_header_alone(server: str) -> None:
    with connect(server) as sock:
        sock.sendall(HEADER.pack(b"GP", 1, FrameType.HELLO, 0, 0, 0, 2**31))  # claims 2 GiB, sends none
        assert fatal_error(read_until_closed(sock)) == ErrorCode.FRAME_TOO_LARGE
    assert ping_works(server)


def test_wrong_token_is_refused(server: str) -> None:
    with connect(server) as sock:
        conn = ClientConnection("alice", b"a-wrong-token-of-some-length")
        sock.sendall(conn.start())
        assert fatal_error(read_until_closed_after_auth(sock, conn)) == ErrorCode.AUTH_FAILED


def read_until_closed_after_auth(
    sock: socket.socket, conn: ClientConnection
) -> list[tuple[FrameType, int, dict[str, object]]]:
    """Answer the CHALLENGE (with whatever proof `conn` computes), then read to the close."""
    frames: list[tuple[FrameType, int, dict[str, object]]] = []
    decoder = FrameDecoder(16 * 1024 * 1024)
    while True:
        data = sock.recv(65536)
        if not data:
            return frames
        decoder.receive_data(data)
        conn.receive_data(data)
        while True:
            event = conn.next_event()
            if event is NEED_DATA or isinstance(event, ConnectionClosed | ConnectionFailed):
                break
        sock.sendall(conn.data_to_send())
        while (frame := decoder.next_frame()) is not None:
            frames.append((frame.type, frame.request_id, unpack_payload(frame.payload)))


def test_replayed_handshake_is_refused(server: str) -> None:
    # Record a successful handshake's bytes, then replay them on a new connection: the server's
    # fresh nonce makes the recorded proof worthless.
    sent: list[bytes] = []
    with connect(server) as sock:
        conn = ClientConnection("alice", TOKENS["alice"].encode())
        sent.append(conn.start())
        sock.sendall(sent[0])
        authenticated = False
        while not authenticated:
            conn.receive_data(sock.recv(65536))
            while (event := conn.next_event()) is not NEED_DATA:
                assert isinstance(event, Authenticated), event
                authenticated = True
            if out := conn.data_to_send():
                sent.append(out)
                sock.sendall(out)
    with connect(server) as sock:
        sock.sendall(sent[0])
        time.sleep(0.1)  # let the CHALLENGE come, then answer with the old proof
        sock.sendall(b"".join(sent[1:]))
        assert fatal_error(read_until_closed(sock)) == ErrorCode.AUTH_FAILED


def test_slow_loris_is_cut_off_at_the_handshake_timeout(server: str) -> None:
    hello = ClientConnection("alice", TOKENS["alice"].encode()).start()
    with connect(server) as sock:
        started = time.monotonic()
        try:
            for byte in hello[:-1]:  # dribble the HELLO, never finishing it
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass
        code = fatal_error(read_until_closed(sock))
        assert code == ErrorCode.HANDSHAKE_TIMEOUT
        assert time.monotonic() - started < HANDSHAKE_TIMEOUT + 5


def test_idle_connection_is_closed(server: str) -> None:
    with connect(server) as sock:
        authenticate(sock)
        assert fatal_error(read_until_closed(sock)) == ErrorCode.IDLE_TIMEOUT


def call(sock: socket.socket, conn: ClientConnection, request: Request) -> object:
    """Send `request` on an authenticated socket; its final reply."""
    rid, data = conn.request(request)
    sock.sendall(data)
    while True:
        data = sock.recv(65536)
        assert data, "the server closed the connection"
        conn.receive_data(data)
        while (event := conn.next_event()) is not NEED_DATA:
            if isinstance(event, ReplyReceived) and event.request_id == rid and event.final:
                return event.message
            assert isinstance(event, ReplyReceived), event


def test_a_connection_that_keeps_talking_is_never_idle(server: str) -> None:
    """The idle timeout (1 s here) counts from a connection's last request, not from its start:
    a ping every 0.4 s for 3 s keeps it open; once it falls silent, it is closed as idle."""
    with connect(server) as sock:
        conn = authenticate(sock)
        until = time.monotonic() + 3
        while time.monotonic() < until:
            assert isinstance(call(sock, conn, Ping()), Pong)
            time.sleep(0.4)
        silent = time.monotonic()
        assert fatal_error(read_until_closed(sock)) == ErrorCode.IDLE_TIMEOUT
        assert 0.5 < time.monotonic() - silent < 5


def test_a_request_in_flight_longer_than_the_idle_timeout_keeps_its_connection(server: str) -> None:
    """Waiting for a job (2.5 s; the pool has no worker, so it stays queued) is not idleness:
    the wait gets its answer, and the connection serves the next request."""
    spec = {"argv": ["true"], "queue": "default"}
    with connect(server) as sock:
        conn = authenticate(sock)
        enqueued = call(sock, conn, Enqueue(spec, None))
        assert isinstance(enqueued, Enqueued)
        waited = call(sock, conn, WaitJobs([enqueued.job_id], 2.5))
        assert isinstance(waited, Waited)
        assert waited.timed_out
        assert isinstance(call(sock, conn, Ping()), Pong)


def test_bad_magic_and_bad_version_are_refused(server: str) -> None:
    for header in (HEADER.pack(b"XX", 1, 1, 0, 0, 0, 0), HEADER.pack(b"GP", 99, 1, 0, 0, 0, 0)):
        with connect(server) as sock:
            sock.sendall(header)
            assert fatal_error(read_until_closed(sock)) in (
                ErrorCode.BAD_MAGIC,
                ErrorCode.UNSUPPORTED_VERSION,
            )


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.binary(min_size=1, max_size=2048))
def test_random_bytes_never_hurt_the_server(server: str, data: bytes) -> None:
    with connect(server) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        frames = read_until_closed(sock, limit=HANDSHAKE_TIMEOUT + 5)  # never hangs past the timeout
        assert all(kind in (FrameType.CHALLENGE, FrameType.ERROR) for kind, _, _ in frames)
    assert ping_works(server)


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(position=st.integers(0, 200), value=st.integers(0, 255), cut=st.integers(0, 3))
def test_mutated_hello_never_hurts_the_server(server: str, position: int, value: int, cut: int) -> None:
    hello = bytearray(ClientConnection("alice", TOKENS["alice"].encode()).start())
    hello[position % len(hello)] = value
    with connect(server) as sock:
        sock.sendall(bytes(hello[: len(hello) - cut]))
        frames = read_until_closed(sock, limit=HANDSHAKE_TIMEOUT + 5)
        assert frames  # a CHALLENGE (the mutation was harmless) or an ERROR, then the close
    assert ping_works(server)


def test_struct_layout_is_fourteen_bytes() -> None:
    assert struct.calcsize(">2sBBBBII") == HEADER.size == 14


def closed_by_server(sock: socket.socket, wait: float = 1.0) -> bytes | None:
    """What the server sent before it closed `sock`, or None if it still holds it open."""
    sock.settimeout(wait)
    got = b""
    try:
        while data := sock.recv(65536):
            got += data
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return got


@pytest.fixture
def patient_server(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[str]:
    """A server that closes idle connections only after 30 s (the test holds some a while)."""
    with poold(redis_server, tmp_path, TOKENS, "--idle-timeout", "30") as address:
        yield address


def test_partly_sent_frames_cannot_take_the_servers_memory(patient_server: str) -> None:
    """Issue 14, finding 9: 30 frames of 16 MiB, each short of its last byte, took the server from
    83 MB to 565 MB. The bytes of partial frames across connections are bounded (64 MiB): past
    it, a connection that needs more is closed, and everyone else is served. (Two users: one
    user's connections may hold half of it, test_server_limits.py.)"""
    frame = encode_frame(FrameType.REQUEST, 1, b"\x00" * (15 * 1024 * 1024))[:-1]  # never complete
    server = patient_server
    socks = [connect(server) for _ in range(6)]
    try:
        for n, sock in enumerate(socks):
            authenticate(sock, ("alice", "bob")[n % 2])
        outcomes = []
        for sock in socks:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(frame)
            outcomes.append(closed_by_server(sock))
        assert [o is None for o in outcomes] == [True] * 4 + [False] * 2  # 4 x 15 MiB fit in 64 MiB
        assert all(b"partly received frames" in o for o in outcomes[4:] if o)
        assert ping_works(server)
    finally:
        for sock in socks:
            sock.close()
