"""Events: what :meth:`Connection.next_event` tells its owner about the bytes it was fed.

Each is a frozen record (protocol/record.py); dispatch on the class with ``match``.
:data:`NEED_DATA` is not an event but the answer "nothing more until you call ``receive_data`` again".
"""

from enum import Enum
from typing import Final, Literal, TypeAlias

from protocol.codec import Reply, Request, StreamItem
from protocol.record import Record

__all__ = [
    "NEED_DATA",
    "Authenticated",
    "CancelRequested",
    "ChannelAcked",
    "ChannelDataReceived",
    "ChannelEndReceived",
    "ChannelResized",
    "ConnectionClosed",
    "ConnectionFailed",
    "DecodeNeeded",
    "Event",
    "GoodbyeReceived",
    "NeedData",
    "PongReceived",
    "ReplyReceived",
    "RequestFailed",
    "RequestReceived",
]


class _Sentinel(Enum):
    NEED_DATA = "NEED_DATA"

    def __repr__(self) -> str:
        return self.value


NEED_DATA: Final = _Sentinel.NEED_DATA
NeedData: TypeAlias = Literal[_Sentinel.NEED_DATA]


class Authenticated(Record):
    """The handshake finished; both sides may now exchange requests.

    On the server, ``peer`` is the client's self-description from HELLO; on the client it is the
    server's name from WELCOME. The limits are the server's: the largest payload it accepts and
    how many requests one connection may have in flight.
    """

    user: str
    peer: str
    max_frame_size: int
    max_in_flight: int


class RequestReceived(Record):
    """Server: a request to carry out; finish it with ``reply`` or ``error`` on ``request_id``."""

    request_id: int
    message: Request


class DecodeNeeded(Record):
    """Server: a request whose payload is larger than the connection decodes itself (its
    ``decode_inline``). Decoding it may take a second of Python: do it where that blocks nobody
    (a thread), with ``protocol.decode_message(FrameType.REQUEST, payload)``, and give the message,
    or the RemoteProtocolError it raised, to ``ServerConnection.decoded``. No event comes before."""

    request_id: int
    payload: bytes


class CancelRequested(Record):
    """Server: the client no longer wants this request; stop it and still send a final frame."""

    request_id: int


class ChannelDataReceived(Record):
    """Server: input on open channel ``request_id``; once the far end has taken it, give its size
    back with ``ServerConnection.credit`` (the client sends no more than the window until then)."""

    request_id: int
    data: bytes


class ChannelEndReceived(Record):
    """Server: the client's input on open channel ``request_id`` has ended (an exec's stdin EOF)."""

    request_id: int


class ChannelAcked(Record):
    """Server: the client took ``size`` more bytes of the channel's output: as many more may go."""

    request_id: int
    size: int


class ChannelResized(Record):
    """Server: the client's terminal is now ``rows`` x ``cols`` (an attach's terminal takes it)."""

    request_id: int
    rows: int
    cols: int


class ReplyReceived(Record):
    """Client: an answer; ``final`` False for a STREAM item, True for the REPLY that ends it."""

    request_id: int
    message: Reply | StreamItem
    final: bool


class RequestFailed(Record):
    """Client: the server ended this request with an error; the connection stays open.

    ``code`` is an :class:`~protocol.errors.ErrorCode` member when known, else the raw number.
    """

    request_id: int
    code: int
    message: str


class PongReceived(Record):
    """The answer to our PING frame, carrying the value we sent."""

    value: int


class GoodbyeReceived(Record):
    """The peer will start no new requests; in-flight ones still finish."""

    reason: str


class ConnectionFailed(Record):
    """The connection is dead because of a protocol error.

    ``by_peer`` False: the peer broke the protocol; an ERROR frame for it waits in
    ``data_to_send()``: write it, then close the transport. ``by_peer`` True: the peer sent a
    fatal ERROR frame (for example AUTH_FAILED or IDLE_TIMEOUT); just close.
    """

    code: int
    message: str
    by_peer: bool


class ConnectionClosed(Record):
    """The connection is over (end of input, or already failed); every later call returns this."""


Event: TypeAlias = (
    Authenticated
    | RequestReceived
    | DecodeNeeded
    | CancelRequested
    | ChannelDataReceived
    | ChannelEndReceived
    | ChannelAcked
    | ChannelResized
    | ReplyReceived
    | RequestFailed
    | PongReceived
    | GoodbyeReceived
    | ConnectionFailed
    | ConnectionClosed
)
