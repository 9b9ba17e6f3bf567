"""Messages: one frozen record (protocol/record.py) per payload; protocol/codec.py (de)codes them.

This module holds what every message shares and the handshake and control messages, which either
side sends (one fixed message type per frame type: HELLO, CHALLENGE, AUTH, WELCOME, ERROR and
GOODBYE), with the sizes they and the channels rely on. The requests a client sends (and its
input on an open channel) are protocol/requests.py; the replies and stream items a server sends,
protocol/replies.py.

REQUEST, REPLY, STREAM and CHANNEL frames carry a map whose ``"op"`` string names the message;
decoding dispatches on it. Every field is required (``None`` is sent as nil where the type allows
it), but for a field a later version added, which has a default: a sender that predates it leaves
it out and means the default; keys a receiver does not know are ignored, which is how later
versions can add fields. A field of the wrong type is a BAD_PAYLOAD protocol error naming the
field: types are checked here, meaning (is that job id real? is the spec valid?) is the daemon's
business.

Job specs, jobs and workers are ``dict[str, Any]`` here; the daemon owns their schema.
"""

from typing import ClassVar, Final

from protocol.frames import FrameType
from protocol.record import Record

__all__ = [
    "CHANNEL_WINDOW",
    "NONCE_SIZE",
    "Auth",
    "Challenge",
    "ErrorMessage",
    "Goodbye",
    "Hello",
    "Welcome",
]

NONCE_SIZE: Final = 32
# Bytes of channel data either side may send on one channel beyond what the other has acknowledged
# (ChannelAck for output, ChannelCredit for input): what one channel can make its peer buffer.
CHANNEL_WINDOW: Final = 256 * 1024
MAC_SIZE: Final = 32  # HMAC-SHA256
MAX_USER_BYTES: Final = 255


# -- handshake and control -------------------------------------------------------------------------


class Hello(Record):
    """Client → server, first frame: the versions it speaks, who it is, its half of the nonce."""

    FRAME: ClassVar = FrameType.HELLO
    versions: list[int]
    user: str
    client_nonce: bytes
    client: str


class Challenge(Record):
    """Server → client: the chosen version and the server's half of the nonce."""

    FRAME: ClassVar = FrameType.CHALLENGE
    version: int
    server_nonce: bytes


class Auth(Record):
    """Client → server: proof of the token (empty when the client has no token)."""

    FRAME: ClassVar = FrameType.AUTH
    mac: bytes


class Welcome(Record):
    """Server → client: authenticated; the limits to respect; proof the server knows the token."""

    FRAME: ClassVar = FrameType.WELCOME
    user: str
    server: str
    max_frame_size: int
    max_in_flight: int
    server_mac: bytes


class ErrorMessage(Record):
    """The payload of an ERROR frame: an ErrorCode number and a sentence for a human."""

    FRAME: ClassVar = FrameType.ERROR
    code: int
    message: str


class Goodbye(Record):
    """Either side: no new requests from me; in-flight ones still finish."""

    FRAME: ClassVar = FrameType.GOODBYE
    reason: str
