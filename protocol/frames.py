"""Frames: the fixed 14-byte header, the incremental decoder, and safe msgpack payloads.

Every frame is a header followed by a msgpack payload (docs/PROTOCOL.md §2)::

    offset  size  field
    0       2     magic, b"GP"
    2       1     version (1)
    3       1     frame type
    4       1     flags (none defined in version 1: must be 0)
    5       1     reserved (must be 0)
    6       4     request id, u32 big-endian
    10      4     payload length, u32 big-endian

The decoder follows h2's ``frame_buffer``: it reads the header first and rejects a length over the
limit *before* buffering any of the body, so a peer cannot make us allocate by promising a large
frame. Consumed bytes are dropped from the front of a ``bytearray`` (CPython makes that cheap by
moving the start pointer), so feeding a long stream costs linear time.
"""

import struct
from collections.abc import Iterator, Mapping
from enum import IntEnum
from typing import Any, Final

import msgpack

from protocol.errors import ErrorCode, FrameTooLarge, LocalProtocolError, RemoteProtocolError
from protocol.record import Record

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "HANDSHAKE_MAX_FRAME_SIZE",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_CONTAINERS",
    "MAX_REQUEST_ID",
    "PROTOCOL_VERSION",
    "Frame",
    "FrameDecoder",
    "FrameType",
    "decode_frames",
    "encode_frame",
    "pack_payload",
    "unpack_payload",
]

MAGIC: Final = b"GP"
PROTOCOL_VERSION: Final = 1
SUPPORTED_VERSIONS: Final = frozenset({PROTOCOL_VERSION})
HEADER: Final = struct.Struct(">2sBBBBII")
HEADER_SIZE: Final = HEADER.size  # 14
MAX_REQUEST_ID: Final = 0xFFFF_FFFF

# The limit on a payload once the handshake is done. The whole frame may be HEADER_SIZE larger.
DEFAULT_MAX_FRAME_SIZE: Final = 16 * 1024 * 1024
# Until a peer has authenticated it may only send handshake frames, which are tiny; a small limit
# keeps an anonymous connection from making the server buffer megabytes.
HANDSHAKE_MAX_FRAME_SIZE: Final = 4096
# msgpack turns one byte into a Python object of 50+ bytes (an empty array becomes a list), so a
# 16 MiB payload of empty arrays would cost about a gigabyte. Capping the number of arrays and maps
# in one payload bounds that blow-up; honest payloads stay far below it.
MAX_CONTAINERS: Final = 262_144
UNPACK_CHUNK: Final = 64 * 1024  # a larger payload is decoded this much at a time (_unpack)


class FrameType(IntEnum):
    """The frame type byte. Grouped so that gaps leave room for later versions."""

    HELLO = 0x01
    CHALLENGE = 0x02
    AUTH = 0x03
    WELCOME = 0x04
    REQUEST = 0x10
    REPLY = 0x11
    STREAM = 0x12
    CANCEL = 0x13
    CHANNEL = 0x14
    ERROR = 0x20
    PING = 0x21
    PONG = 0x22
    GOODBYE = 0x23


# Frames about the connection as a whole carry request id 0; frames about a request never do.
# ERROR may carry either (0 = fatal), PING/PONG carry an opaque value that the PONG echoes.
_ZERO_ID: Final = frozenset(
    {FrameType.HELLO, FrameType.CHALLENGE, FrameType.AUTH, FrameType.WELCOME, FrameType.GOODBYE}
)
_NONZERO_ID: Final = frozenset(
    {FrameType.REQUEST, FrameType.REPLY, FrameType.STREAM, FrameType.CANCEL, FrameType.CHANNEL}
)
_FRAME_TYPES: Final = frozenset(int(t) for t in FrameType)


class Frame(Record):
    """One decoded frame; ``payload`` is still msgpack (see :func:`unpack_payload`)."""

    type: FrameType
    request_id: int
    payload: bytes


def _check_request_id(frame_type: FrameType, request_id: int) -> str | None:
    """Return why ``request_id`` is illegal for ``frame_type``, or None if it is fine."""
    if frame_type in _ZERO_ID and request_id != 0:
        return f"a {frame_type.name} frame must carry request id 0, not {request_id}"
    if frame_type in _NONZERO_ID and request_id == 0:
        return f"a {frame_type.name} frame must carry a nonzero request id"
    return None


def encode_frame(
    frame_type: FrameType,
    request_id: int,
    payload: bytes,
    *,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
) -> bytes:
    """Return the bytes of one frame; raise LocalProtocolError if the peer would reject it."""
    if not 0 <= request_id <= MAX_REQUEST_ID:
        raise LocalProtocolError(
            ErrorCode.BAD_HEADER,
            f"Request id {request_id} does not fit in 32 bits; use 1 to {MAX_REQUEST_ID}.",
        )
    problem = _check_request_id(frame_type, request_id)
    if problem is not None:
        raise LocalProtocolError(ErrorCode.BAD_HEADER, f"Cannot send: {problem}.")
    if len(payload) > max_frame_size:
        raise FrameTooLarge(frame_type.name, len(payload), max_frame_size)
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, frame_type, 0, 0, request_id, len(payload)) + payload


class FrameDecoder:
    """Turn a byte stream into :class:`Frame` objects, checking every header before buffering.

    Feed bytes with :meth:`receive_data`; take frames with :meth:`next_frame` (or iterate). A framing
    error raises :class:`RemoteProtocolError`; the decoder then drops its buffer, ignores further
    input and raises the same error again if asked, because a byte stream that lost its framing
    cannot be resynchronised. After every frame has been taken, at most
    ``HEADER_SIZE + max_frame_size`` bytes stay buffered.
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.max_frame_size = max_frame_size
        self._buffer = bytearray()
        self._error: RemoteProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        return len(self._buffer)

    def receive_data(self, data: bytes) -> None:
        """Append ``data`` to the buffer; frames are parsed lazily by :meth:`next_frame`."""
        if self._error is None:
            self._buffer += data

    def next_frame(self) -> Frame | None:
        """Return the next complete frame, or None if more bytes are needed."""
        if self._error is not None:
            raise self._error
        try:
            return self._parse()
        except RemoteProtocolError as exc:
            self._error = exc
            self._buffer = bytearray()  # release the memory now; nothing more will be parsed
            raise

    def __iter__(self) -> Iterator[Frame]:
        while (frame := self.next_frame()) is not None:
            yield frame

    def _parse(self) -> Frame | None:
        buffer = self._buffer
        if len(buffer) < HEADER_SIZE:
            # Reject a wrong magic as soon as its first byte arrives: a stray HTTP client or a
            # port scanner gets its answer without us waiting for 14 bytes that may never come.
            if not MAGIC.startswith(bytes(buffer[:2])):
                raise self._bad_magic(bytes(buffer[:2]))
            return None
        frame_type, request_id, length = self._check_header(buffer)
        end = HEADER_SIZE + length
        if len(buffer) < end:
            return None
        payload = bytes(buffer[HEADER_SIZE:end])
        del buffer[:end]
        return Frame(frame_type, request_id, payload)

    def _check_header(self, buffer: bytearray) -> tuple[FrameType, int, int]:
        """Validate the header at the start of ``buffer``; return (type, request id, length)."""
        magic, version, type_byte, flags, reserved, request_id, length = HEADER.unpack_from(buffer)
        if magic != MAGIC:
            raise self._bad_magic(magic)
        if version not in SUPPORTED_VERSIONS:
            raise RemoteProtocolError(
                ErrorCode.UNSUPPORTED_VERSION,
                f"Frame version {version} is not supported (this side speaks {sorted(SUPPORTED_VERSIONS)}); "
                "upgrade the older side.",
            )
        if type_byte not in _FRAME_TYPES:
            raise RemoteProtocolError(
                ErrorCode.UNKNOWN_FRAME_TYPE,
                f"Frame type 0x{type_byte:02x} is unknown; the peer may speak a newer protocol version.",
            )
        frame_type = FrameType(type_byte)
        if flags != 0 or reserved != 0:
            raise RemoteProtocolError(
                ErrorCode.BAD_HEADER,
                f"The flags and reserved header bytes must be 0 in version 1 (got 0x{flags:02x}, "
                f"0x{reserved:02x}); the peer is not a gpupool v1 implementation.",
            )
        problem = _check_request_id(frame_type, request_id)
        if problem is not None:
            raise RemoteProtocolError(ErrorCode.BAD_HEADER, f"Bad frame header: {problem}.")
        if length > self.max_frame_size:
            raise RemoteProtocolError(
                ErrorCode.FRAME_TOO_LARGE,
                f"A {frame_type.name} frame of {length} bytes exceeds the limit of {self.max_frame_size} "
                "bytes; send less per frame.",
            )
        return frame_type, request_id, length

    @staticmethod
    def _bad_magic(seen: bytes) -> RemoteProtocolError:
        return RemoteProtocolError(
            ErrorCode.BAD_MAGIC,
            f"Frames must start with b'GP' but this one starts with {seen!r}; "
            "point a gpupool client (poolctl) at this port, not some other protocol.",
        )


def pack_payload(payload: Mapping[str, Any]) -> bytes:
    """Encode a payload map as msgpack (bytes as bin, str as str); no extension types."""
    try:
        return msgpack.packb(payload, use_bin_type=True, datetime=False)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(
            ErrorCode.BAD_PAYLOAD,
            f"Cannot encode payload as msgpack ({exc}); send only maps, arrays, str, bytes, int, "
            "float, bool and None.",
        ) from exc


class _Guard:
    """msgpack hooks that count containers and reject what plain data cannot contain.

    ``ext_hook`` catches extension types, but msgpack decodes its timestamp extension (-1) itself,
    so the container hooks look for Timestamp values; they also insist on str keys in every map
    (``strict_map_key`` still lets bytes keys through).
    """

    __slots__ = ("containers",)

    def __init__(self) -> None:
        self.containers = 0

    def _count(self) -> None:
        self.containers += 1
        if self.containers > MAX_CONTAINERS:
            raise _Rejected(f"more than {MAX_CONTAINERS} arrays and maps in one payload")

    def on_list(self, items: list[Any]) -> list[Any]:
        self._count()
        for item in items:
            if type(item) is msgpack.Timestamp:
                raise _Rejected("a msgpack timestamp (extension types are not allowed)")
        return items

    def on_map(self, mapping: dict[Any, Any]) -> dict[Any, Any]:
        self._count()
        for key, value in mapping.items():
            if type(key) is not str:
                raise _Rejected(f"a map key of type {type(key).__name__} (keys must be strings)")
            if type(value) is msgpack.Timestamp:
                raise _Rejected("a msgpack timestamp (extension types are not allowed)")
        return mapping


class _Rejected(ValueError):
    """Raised from inside msgpack hooks; a ValueError so it surfaces like msgpack's own errors."""


def _reject_ext(code: int, data: bytes) -> Any:
    raise _Rejected(f"a msgpack extension of type {code} (extension types are not allowed)")


def unpack_payload(payload: bytes) -> dict[str, Any]:
    """Decode a msgpack payload that must be a map with str keys; raise RemoteProtocolError if not.

    Safe on hostile input: str is decoded as UTF-8 (``raw=False``), map keys must be str, extension
    types are refused, and no length may exceed the payload's own size, so msgpack never
    preallocates more than it was sent. (``max_buffer_size`` only concerns msgpack's streaming
    ``Unpacker``, which is not used: :class:`FrameDecoder` already bounds the buffer.)
    """
    guard = _Guard()
    size = len(payload)
    try:
        value = _unpack(
            payload,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_reject_ext,
            list_hook=guard.on_list,
            object_hook=guard.on_map,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size // 2,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        # ValueError covers msgpack's FormatError/StackError/ExtraData, bad UTF-8 and our _Rejected.
        raise RemoteProtocolError(
            ErrorCode.BAD_PAYLOAD,
            f"The payload is not acceptable msgpack ({_describe(exc)}); fix the sender.",
        ) from exc
    if not isinstance(value, dict):
        raise RemoteProtocolError(
            ErrorCode.BAD_PAYLOAD,
            f"The payload must be a msgpack map, not {type(value).__name__}; fix the sender.",
        )
    return value


def _unpack(payload: bytes, **options: Any) -> Any:
    """msgpack.unpackb, but a large payload is decoded UNPACK_CHUNK bytes at a time (the decoder
    resumes where it stopped): a thread decoding it lets go of the GIL between chunks, so a
    server that decodes large requests off its event loop keeps serving meanwhile."""
    size = len(payload)
    if size <= UNPACK_CHUNK:
        return msgpack.unpackb(payload, **options)
    unpacker = msgpack.Unpacker(max_buffer_size=size, **options)
    view = memoryview(payload)
    for start in range(0, size, UNPACK_CHUNK):
        unpacker.feed(view[start : start + UNPACK_CHUNK])
        try:
            value = unpacker.unpack()
        except msgpack.OutOfData:
            continue
        if unpacker.tell() != size:
            raise ValueError(f"extra data after the value ({size - unpacker.tell()} bytes)")
        return value
    raise ValueError("the payload ends inside a value")


def _describe(exc: BaseException) -> str:
    text = str(exc)
    # Keep hostile input out of our error sentences beyond a short excerpt.
    return (text[:120] + "...") if len(text) > 120 else (text or type(exc).__name__)


def decode_frames(data: bytes, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> list[Frame]:
    """Decode a complete byte string into frames (a convenience for tests and tools)."""
    decoder = FrameDecoder(max_frame_size)
    decoder.receive_data(data)
    frames = list(decoder)
    if decoder.buffered:
        raise RemoteProtocolError(
            ErrorCode.BAD_PAYLOAD, f"{decoder.buffered} bytes at the end do not form a complete frame."
        )
    return frames
