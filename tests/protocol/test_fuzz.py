"""Hostile input: whatever bytes arrive, the decoder and the connections only ever report a
protocol error, always finish, and never buffer more than one maximal frame (docs/DESIGN.md §10)."""

import contextlib
import os
import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import (
    CancelJobs,
    ClientConnection,
    ConnectionFailed,
    Enqueue,
    EnqueueBatch,
    FollowLogs,
    JobList,
    ListJobs,
    LogChunk,
    LogEnd,
    Ping,
    Request,
    ServerConnection,
    ShowJob,
    WaitJobs,
    codec,
    messages,
    replies,
    requests,
)
from protocol.errors import ErrorCode, RemoteProtocolError
from protocol.frames import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    FrameDecoder,
    FrameType,
    decode_frames,
    pack_payload,
)
from protocol.record import fields

from .helpers import TOKENS, Pair, drain, is_record

# Deterministic for CI (no example database, fixed seed) and modest, so the suite stays fast. A long run
# asks for more inputs per test: `GPUPOOL_FUZZ_EXAMPLES=11112 pytest tests/protocol/test_fuzz.py
# --timeout=0 --hypothesis-show-statistics` feeds the nine tests 10^5 inputs together.
FUZZ_EXAMPLES = int(os.environ.get("GPUPOOL_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

chunks = st.lists(st.binary(max_size=48), max_size=24)

# Plain msgpack values, nested: what a hostile but well-formed msgpack encoder can send.
scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
values = st.recursive(
    scalars | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


def feed_decoder(decoder: FrameDecoder, pieces: list[bytes]) -> None:
    for piece in pieces:
        decoder.receive_data(piece)
        try:
            for _ in decoder:
                pass
        except RemoteProtocolError:
            assert decoder.buffered == 0
            return
        # Everything complete has been taken: what is left is less than one maximal frame.
        assert decoder.buffered < HEADER_SIZE + decoder.max_frame_size + 1


def feed(connection: ServerConnection | ClientConnection, data: bytes, split_seed: int) -> None:
    """Deliver ``data`` in random pieces; only events may come out, and a failure is an ERROR frame."""
    rng = random.Random(split_seed)
    position = 0
    while position < len(data):
        size = rng.randint(1, 64)
        connection.receive_data(data[position : position + size])
        position += size
        events = drain(connection)  # raises if next_event never says NEED_DATA
        assert connection._decoder.buffered <= HEADER_SIZE + connection._decoder.max_frame_size
        for event in events:
            if isinstance(event, ConnectionFailed) and not event.by_peer:
                # The ERROR comes last (a CHALLENGE or PONG may precede it in the same batch).
                frame = decode_frames(connection.data_to_send())[-1]
                assert frame.type is FrameType.ERROR
                assert frame.request_id == 0
        connection.data_to_send()


@FUZZ
@given(pieces=chunks, max_frame_size=st.integers(0, 64))
def test_decoder_arbitrary_bytes(pieces: list[bytes], max_frame_size: int) -> None:
    feed_decoder(FrameDecoder(max_frame_size), pieces)


@FUZZ
@given(pieces=chunks)
def test_decoder_arbitrary_bytes_after_magic(pieces: list[bytes]) -> None:
    # Starting with the magic and version gets past the first checks into the rest of the header.
    feed_decoder(FrameDecoder(32), [MAGIC + b"\x01", *pieces])


@FUZZ
@given(data=st.binary(max_size=600), split_seed=st.integers(0, 2**16))
def test_server_arbitrary_bytes(data: bytes, split_seed: int) -> None:
    server = ServerConnection(TOKENS)
    feed(server, data, split_seed)
    assert server.user is None  # random bytes never authenticate


frame_types = st.sampled_from(list(FrameType)) | st.integers(0, 255)
request_ids = st.sampled_from([0, 1, 2, 3, 0xFFFF_FFFF]) | st.integers(0, 2**32 - 1)
payloads = st.builds(pack_payload, st.dictionaries(st.text(max_size=12), values, max_size=5)) | st.binary(
    max_size=40
)


@st.composite
def framed(draw: st.DrawFn) -> bytes:
    """A frame with a valid header shape but any type, id and payload."""
    payload = draw(payloads)
    frame_type = draw(frame_types)
    return HEADER.pack(MAGIC, 1, frame_type, 0, 0, draw(request_ids), len(payload)) + payload


@FUZZ
@given(frames=st.lists(framed(), max_size=8), split_seed=st.integers(0, 2**16))
def test_authenticated_server_arbitrary_frames(frames: list[bytes], split_seed: int) -> None:
    pair = Pair(max_frame_size=4096, max_in_flight=4).connect()
    feed(pair.server, b"".join(frames), split_seed)


@FUZZ
@given(frames=st.lists(framed(), max_size=8), split_seed=st.integers(0, 2**16))
def test_authenticated_client_arbitrary_frames(frames: list[bytes], split_seed: int) -> None:
    pair = Pair().connect()
    pair.client.request(FollowLogs("j", follow=True, offset=""))
    pair.client.request(Ping())
    feed(pair.client, b"".join(frames), split_seed)


# Every request op with fields drawn from every message's field names: exercises the type checks.
MESSAGES = [cls for module in (messages, requests, replies) for cls in vars(module).values()]
FIELD_NAMES = sorted({name for cls in MESSAGES if is_record(cls) for name in fields(cls)})
OPS = sorted(cls.OP for cls in MESSAGES if hasattr(cls, "OP"))


@FUZZ
@given(
    op=st.sampled_from(OPS),
    fields=st.dictionaries(st.sampled_from(FIELD_NAMES), values, max_size=6),
    frame_type=st.sampled_from([FrameType.REQUEST, FrameType.REPLY, FrameType.STREAM, FrameType.HELLO]),
)
def test_decode_message_arbitrary_fields(op: str, fields: dict[str, Any], frame_type: FrameType) -> None:
    with contextlib.suppress(RemoteProtocolError):
        codec.decode_message(frame_type, pack_payload({"op": op, **fields}))


# -- mutations of valid traffic ------------------------------------------------------------------------

mutations = st.lists(
    st.tuples(st.sampled_from(["flip", "insert", "delete"]), st.integers(0, 10**6), st.integers(0, 255)),
    min_size=1,
    max_size=4,
)


def mutate(data: bytes, edits: list[tuple[str, int, int]]) -> bytes:
    buffer = bytearray(data)
    for kind, where, byte in edits:
        index = where % (len(buffer) + 1)
        if kind == "insert":
            buffer.insert(index, byte)
        elif buffer and index < len(buffer):
            if kind == "flip":
                buffer[index] ^= byte or 1
            else:
                del buffer[index]
    return bytes(buffer)


def client_traffic(pair: Pair) -> bytes:
    """Valid client → server bytes after the handshake, one of each kind of frame."""
    data = b""
    requests: list[Request] = [
        Enqueue({"argv": ["python", "train.py"], "gpus": 1}, "key"),
        EnqueueBatch([{"argv": ["a"]}]),
        ListJobs("default", None, include_finished=True, limit=50),
        ShowJob("j"),
        CancelJobs(["j"]),
        WaitJobs(["j"], 1.5),
        FollowLogs("j", follow=True, offset=""),
    ]
    for request in requests:
        data += pair.client.request(request)[1]
    return data + pair.client.cancel(7) + pair.client.ping(3) + pair.client.goodbye("bye")


@FUZZ
@given(edits=mutations, split_seed=st.integers(0, 2**16))
def test_server_mutated_requests(edits: list[tuple[str, int, int]], split_seed: int) -> None:
    pair = Pair(max_in_flight=16).connect()
    feed(pair.server, mutate(client_traffic(pair), edits), split_seed)


@FUZZ
@given(edits=mutations, split_seed=st.integers(0, 2**16))
def test_server_mutated_handshake(edits: list[tuple[str, int, int]], split_seed: int) -> None:
    pair = Pair()
    hello = pair.client.start()
    pair.to_server(hello)
    pair.to_client(pair.server.data_to_send())
    transcript = hello + pair.client.data_to_send()
    server = ServerConnection(TOKENS)
    feed(server, mutate(transcript, edits), split_seed)


@FUZZ
@given(edits=mutations, split_seed=st.integers(0, 2**16))
def test_client_mutated_replies(edits: list[tuple[str, int, int]], split_seed: int) -> None:
    pair = Pair().connect()
    follow = pair.request(FollowLogs("j", follow=True, offset=""))
    listing = pair.request(ListJobs(None, None, include_finished=False, limit=5))
    ping = pair.request(Ping())
    data = pair.server.stream(follow, LogChunk(b"epoch 1\n", "1"))
    data += pair.server.reply(listing, JobList([{"id": "j", "state": "queued"}]))
    data += pair.server.error(ping, ErrorCode.NOT_FOUND, "Not found.")
    data += pair.server.reply(follow, LogEnd("succeeded", 0))
    data += pair.server.ping(1) + pair.server.goodbye("restart")
    feed(pair.client, mutate(data, edits), split_seed)
