"""The frame header, the incremental decoder and safe msgpack payloads."""

import random
import struct

import msgpack
import pytest

from protocol.errors import ErrorCode, FrameTooLarge, LocalProtocolError, RemoteProtocolError
from protocol.frames import (
    HEADER_SIZE,
    MAX_CONTAINERS,
    UNPACK_CHUNK,
    Frame,
    FrameDecoder,
    FrameType,
    decode_frames,
    encode_frame,
    pack_payload,
    unpack_payload,
)


def header(
    frame_type: int = FrameType.REQUEST,
    request_id: int = 1,
    length: int = 0,
    *,
    magic: bytes = b"GP",
    version: int = 1,
    flags: int = 0,
    reserved: int = 0,
) -> bytes:
    return struct.pack(">2sBBBBII", magic, version, frame_type, flags, reserved, request_id, length)


FRAMES = [
    Frame(FrameType.HELLO, 0, pack_payload({"user": "alice"})),
    Frame(FrameType.REQUEST, 1, pack_payload({"op": "ping"})),
    Frame(
        FrameType.STREAM, 7, pack_payload({"op": "log_chunk", "data": bytes(range(256)) * 40, "offset": "9"})
    ),
    Frame(FrameType.PING, 0xFFFF_FFFF, b""),
    Frame(FrameType.ERROR, 0, pack_payload({"code": 15, "message": "x"})),
]
STREAM = b"".join(encode_frame(f.type, f.request_id, f.payload) for f in FRAMES)


def test_header_layout_is_14_bytes_big_endian() -> None:
    data = encode_frame(FrameType.REQUEST, 0x01020304, b"\x80")
    assert HEADER_SIZE == 14
    assert data == b"GP\x01\x10\x00\x00\x01\x02\x03\x04\x00\x00\x00\x01\x80"


def test_decode_whole_stream() -> None:
    assert decode_frames(STREAM) == FRAMES


def test_decode_one_byte_at_a_time() -> None:
    decoder = FrameDecoder()
    frames: list[Frame] = []
    for index in range(len(STREAM)):
        decoder.receive_data(STREAM[index : index + 1])
        frames.extend(decoder)
    assert frames == FRAMES
    assert decoder.buffered == 0


@pytest.mark.parametrize("seed", range(20))
def test_decode_random_splits(seed: int) -> None:
    rng = random.Random(seed)
    decoder = FrameDecoder()
    frames: list[Frame] = []
    position = 0
    while position < len(STREAM):
        size = rng.randint(1, 600)
        decoder.receive_data(STREAM[position : position + size])
        position += size
        frames.extend(decoder)
    assert frames == FRAMES


def test_partial_frame_waits_for_more() -> None:
    data = encode_frame(FrameType.REQUEST, 3, b"\x81\xa2op\xa4ping")
    decoder = FrameDecoder()
    decoder.receive_data(data[:-1])
    assert decoder.next_frame() is None
    decoder.receive_data(data[-1:])
    assert decoder.next_frame() == Frame(FrameType.REQUEST, 3, b"\x81\xa2op\xa4ping")
    assert decoder.next_frame() is None


def test_oversize_length_rejected_from_header_alone() -> None:
    decoder = FrameDecoder(max_frame_size=1024)
    decoder.receive_data(header(length=2 * 1024**3))  # claims 2 GiB; not one body byte sent
    with pytest.raises(RemoteProtocolError) as caught:
        decoder.next_frame()
    assert caught.value.code is ErrorCode.FRAME_TOO_LARGE
    assert decoder.buffered == 0


def test_frame_at_the_limit_is_accepted() -> None:
    decoder = FrameDecoder(max_frame_size=10)
    decoder.receive_data(encode_frame(FrameType.REQUEST, 1, b"x" * 10))
    assert decoder.next_frame() == Frame(FrameType.REQUEST, 1, b"x" * 10)


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (header(magic=b"HT"), ErrorCode.BAD_MAGIC),
        (b"GET / HTTP/1.1\r\n", ErrorCode.BAD_MAGIC),
        (b"X", ErrorCode.BAD_MAGIC),  # rejected from the first byte
        (b"GQ", ErrorCode.BAD_MAGIC),
        (header(version=2), ErrorCode.UNSUPPORTED_VERSION),
        (header(version=0), ErrorCode.UNSUPPORTED_VERSION),
        (header(frame_type=0x00), ErrorCode.UNKNOWN_FRAME_TYPE),
        (header(frame_type=0x05), ErrorCode.UNKNOWN_FRAME_TYPE),
        (header(frame_type=0xFF), ErrorCode.UNKNOWN_FRAME_TYPE),
        (header(reserved=1), ErrorCode.BAD_HEADER),
        (header(flags=0x80), ErrorCode.BAD_HEADER),
        (header(FrameType.REQUEST, request_id=0), ErrorCode.BAD_HEADER),
        (header(FrameType.CANCEL, request_id=0), ErrorCode.BAD_HEADER),
        (header(FrameType.HELLO, request_id=5), ErrorCode.BAD_HEADER),
        (header(FrameType.GOODBYE, request_id=5), ErrorCode.BAD_HEADER),
    ],
)
def test_bad_headers(data: bytes, code: ErrorCode) -> None:
    decoder = FrameDecoder()
    decoder.receive_data(data)
    with pytest.raises(RemoteProtocolError) as caught:
        decoder.next_frame()
    assert caught.value.code is code
    assert caught.value.message.endswith(".")


def test_decoder_stays_failed() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(b"nope")
    with pytest.raises(RemoteProtocolError):
        decoder.next_frame()
    decoder.receive_data(STREAM)  # a good stream afterwards changes nothing: framing is lost
    assert decoder.buffered == 0
    with pytest.raises(RemoteProtocolError):
        decoder.next_frame()


def test_frames_before_an_error_are_delivered() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(STREAM + b"junk")
    assert [decoder.next_frame() for _ in FRAMES] == FRAMES
    with pytest.raises(RemoteProtocolError):
        decoder.next_frame()


def test_decode_frames_rejects_trailing_bytes() -> None:
    with pytest.raises(RemoteProtocolError):
        decode_frames(STREAM + b"GP")


def test_long_stream_is_consumed_incrementally() -> None:
    # Many small frames: the buffer shrinks as frames are taken, it never holds them all.
    one = encode_frame(FrameType.PING, 1, b"\x80")
    decoder = FrameDecoder()
    for _ in range(2000):
        decoder.receive_data(one * 5)
        assert len(list(decoder)) == 5
        assert decoder.buffered == 0


def test_encode_checks() -> None:
    with pytest.raises(FrameTooLarge) as too_large:  # its sizes, for the caller's sentence
        encode_frame(FrameType.REQUEST, 1, b"x" * 11, max_frame_size=10)
    assert (too_large.value.code, too_large.value.size, too_large.value.limit) == (
        ErrorCode.FRAME_TOO_LARGE,
        11,
        10,
    )
    with pytest.raises(LocalProtocolError):
        encode_frame(FrameType.REQUEST, 1 << 32, b"")
    with pytest.raises(LocalProtocolError):
        encode_frame(FrameType.REQUEST, -1, b"")
    with pytest.raises(LocalProtocolError):
        encode_frame(FrameType.REPLY, 0, b"")
    with pytest.raises(LocalProtocolError):
        encode_frame(FrameType.WELCOME, 3, b"")


# -- payloads ------------------------------------------------------------------------------------------


def test_payload_round_trip() -> None:
    value = {"s": "é", "b": b"\x00\xff", "i": -(2**63), "u": 2**64 - 1, "f": 1.5, "n": None, "l": [1, [2]]}
    assert unpack_payload(pack_payload(value)) == value


def test_pack_rejects_unknown_types() -> None:
    with pytest.raises(LocalProtocolError) as caught:
        pack_payload({"x": object()})
    assert caught.value.code is ErrorCode.BAD_PAYLOAD
    with pytest.raises(LocalProtocolError):
        pack_payload({"x": 2**64})


@pytest.mark.parametrize(
    "payload",
    [
        b"",  # nothing
        b"\xc1",  # never-used byte
        b"\x81\xa1a",  # truncated map
        b"\x80\x80",  # extra data after the map
        b"\x91\x01",  # an array, not a map
        b"\xa3abc",  # a string, not a map
        b"\x81\x01\x02",  # int key
        b"\x81\xc4\x01k\x01",  # bytes key
        b"\x81\xa1k\x81\x01\x02",  # int key in a nested map
        b"\x81\xa2\xff\xfe\x01",  # invalid UTF-8 in a str
        b"\x81\xa1k\xd4\x05\x00",  # ext type 5
        msgpack.packb({"k": msgpack.Timestamp(1, 0)}),  # the timestamp extension
        msgpack.packb({"k": [msgpack.Timestamp(1, 0)]}),
        b"\x81\xa1k" + b"\x91" * 5000 + b"\x80",  # nested deeper than msgpack's stack
        b"\x81\xa1k\xdd\xff\xff\xff\xff",  # array claiming 4 billion items
        b"\x81\xa1k\xdb\xff\xff\xff\xff",  # str claiming 4 GiB
        b"\x81\xa1k\xc6\xff\xff\xff\xff",  # bin claiming 4 GiB
        b"\xdf\xff\xff\xff\xff",  # map claiming 4 billion pairs
    ],
)
def test_unpack_rejects(payload: bytes) -> None:
    with pytest.raises(RemoteProtocolError) as caught:
        unpack_payload(payload)
    assert caught.value.code is ErrorCode.BAD_PAYLOAD


BIG: dict[str, object] = {
    "pad": b"x" * (2 * UNPACK_CHUNK),
    "ids": [f"job-{i}" for i in range(UNPACK_CHUNK // 4)],
    "n": 1,
}


def test_a_payload_decoded_in_chunks_is_the_same_value() -> None:
    payload = pack_payload(BIG)
    assert len(payload) > 3 * UNPACK_CHUNK
    assert unpack_payload(payload) == BIG


@pytest.mark.parametrize(
    "payload",
    [
        pack_payload(BIG) + b"\x80",  # extra data after the map, past the first chunks
        pack_payload(BIG)[:-1],  # ends inside a value
        pack_payload(BIG)[: 2 * UNPACK_CHUNK + 5],  # ends inside the first chunks' string
        msgpack.packb({**BIG, "k": [msgpack.Timestamp(1, 0)]}),  # the checks hold in every chunk
        msgpack.packb({**BIG, "n": {1: 2}}),  # an int key, in the last chunk
    ],
)
def test_a_large_payload_is_checked_as_a_small_one_is(payload: bytes) -> None:
    assert len(payload) > UNPACK_CHUNK
    with pytest.raises(RemoteProtocolError) as caught:
        unpack_payload(payload)
    assert caught.value.code is ErrorCode.BAD_PAYLOAD


def test_unpack_limits_number_of_containers() -> None:
    many = len(pack_payload({"k": [[]] * MAX_CONTAINERS}))
    assert many < 1024 * 1024  # small on the wire, yet a quarter million Python lists
    with pytest.raises(RemoteProtocolError, match="arrays and maps"):
        unpack_payload(pack_payload({"k": [[]] * MAX_CONTAINERS}))
    assert len(unpack_payload(pack_payload({"k": [[]] * (MAX_CONTAINERS - 2)}))["k"]) == MAX_CONTAINERS - 2
