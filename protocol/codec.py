"""The messages' codec: which request each reply and stream item answers (the table docs/PROTOCOL.md
§3 gives), the unions of them, and the strict msgpack encoding and decoding of every payload.

The vocabulary itself, one frozen record per message, is protocol/messages.py (handshake and
control), requests.py and replies.py; this is how a frame's
payload becomes one of them and back: REQUEST, REPLY, STREAM and CHANNEL frames carry a map whose
``"op"`` names the message, the handshake, ERROR and GOODBYE frames one fixed type each.
"""

from typing import Any, Final, TypeAlias

from protocol.checks import bad_field, build, schema
from protocol.errors import ErrorCode, RemoteProtocolError
from protocol.frames import FrameType, pack_payload, unpack_payload
from protocol.messages import (
    MAC_SIZE,
    MAX_USER_BYTES,
    NONCE_SIZE,
    Auth,
    Challenge,
    ErrorMessage,
    Goodbye,
    Hello,
    Welcome,
)
from protocol.record import fields
from protocol.replies import (
    Accounted,
    AgentAnswer,
    AgentOrder,
    Cancelled,
    ChannelClosed,
    ChannelCredit,
    ChannelOutput,
    DownloadTicket,
    Enqueued,
    EnqueuedBatch,
    JobDetail,
    JobEnded,
    JobList,
    LogChunk,
    LogEnd,
    ObjectRef,
    ObjectsHeld,
    Pong,
    PoolView,
    Requeued,
    Served,
    UploadTicket,
    Waited,
    WatchEnded,
    WorkerList,
)
from protocol.requests import (
    Account,
    AgentCall,
    CancelJobs,
    ChannelAck,
    ChannelData,
    ChannelEnd,
    ChannelResize,
    CheckObjects,
    Enqueue,
    EnqueueBatch,
    FinishUpload,
    FollowLogs,
    ListJobs,
    ListWorkers,
    OpenChannel,
    Ping,
    PrepareDownload,
    PrepareUpload,
    RequeueJobs,
    ResolveName,
    ServeJobs,
    ShowJob,
    WaitJobs,
    WatchPool,
)

__all__ = [
    "ChannelInput",
    "Control",
    "Message",
    "Reply",
    "Request",
    "StreamItem",
    "decode_message",
    "encode_message",
    "reply_type",
    "stream_type",
]

Request: TypeAlias = (
    Enqueue
    | EnqueueBatch
    | ListJobs
    | ShowJob
    | CancelJobs
    | RequeueJobs
    | WaitJobs
    | FollowLogs
    | WatchPool
    | ListWorkers
    | Ping
    | PrepareUpload
    | CheckObjects
    | FinishUpload
    | ResolveName
    | PrepareDownload
    | ServeJobs
    | AgentCall
    | OpenChannel
    | Account
)
Reply: TypeAlias = (
    Enqueued
    | EnqueuedBatch
    | JobList
    | JobDetail
    | Cancelled
    | Requeued
    | Waited
    | LogEnd
    | WatchEnded
    | WorkerList
    | Pong
    | UploadTicket
    | ObjectsHeld
    | ObjectRef
    | DownloadTicket
    | Served
    | AgentAnswer
    | ChannelClosed
    | Accounted
)
StreamItem: TypeAlias = LogChunk | JobEnded | PoolView | AgentOrder | ChannelOutput | ChannelCredit
ChannelInput: TypeAlias = ChannelData | ChannelEnd | ChannelAck | ChannelResize
Control: TypeAlias = Hello | Challenge | Auth | Welcome | ErrorMessage | Goodbye
Message: TypeAlias = Control | Request | Reply | StreamItem | ChannelInput

# Which reply ends each request, and which items (if any) it may stream before that.
_REPLY_FOR: Final[dict[type[Any], type[Any]]] = {
    Enqueue: Enqueued,
    EnqueueBatch: EnqueuedBatch,
    ListJobs: JobList,
    ShowJob: JobDetail,
    CancelJobs: Cancelled,
    RequeueJobs: Requeued,
    WaitJobs: Waited,
    FollowLogs: LogEnd,
    WatchPool: WatchEnded,
    ListWorkers: WorkerList,
    Ping: Pong,
    PrepareUpload: UploadTicket,
    CheckObjects: ObjectsHeld,
    FinishUpload: ObjectRef,
    ResolveName: ObjectRef,
    PrepareDownload: DownloadTicket,
    ServeJobs: Served,
    AgentCall: AgentAnswer,
    OpenChannel: ChannelClosed,
    Account: Accounted,
}
_STREAM_FOR: Final[dict[type[Any], tuple[type[Any], ...]]] = {
    FollowLogs: (LogChunk,),
    WaitJobs: (JobEnded,),
    WatchPool: (PoolView,),
    ServeJobs: (AgentOrder,),
    OpenChannel: (ChannelOutput, ChannelCredit),
}
_STREAMED: Final[frozenset[type[Any]]] = frozenset(c for classes in _STREAM_FOR.values() for c in classes)
_CHANNEL_INPUT: Final[tuple[type[Any], ...]] = (ChannelData, ChannelEnd, ChannelAck, ChannelResize)

_BY_OP: Final[dict[FrameType, dict[str, type[Any]]]] = {
    FrameType.REQUEST: {cls.OP: cls for cls in _REPLY_FOR},
    FrameType.REPLY: {cls.OP: cls for cls in _REPLY_FOR.values()},
    FrameType.STREAM: {cls.OP: cls for cls in _STREAMED},
    FrameType.CHANNEL: {cls.OP: cls for cls in _CHANNEL_INPUT},
}
_CONTROL: Final[dict[FrameType, type[Any]]] = {
    cls.FRAME: cls for cls in (Hello, Challenge, Auth, Welcome, ErrorMessage, Goodbye)
}


# Every field of every message has a checker: fail at import, not on the first message received.
for _cls in (*_CONTROL.values(), *_REPLY_FOR, *_REPLY_FOR.values(), *_STREAMED, *_CHANNEL_INPUT):
    schema(_cls)


def reply_type(request: type[Any]) -> type[Any]:
    """The reply class that finishes a request of class ``request``."""
    return _REPLY_FOR[request]


def stream_type(request: type[Any]) -> tuple[type[Any], ...]:
    """The STREAM item classes a request of class ``request`` may produce (none: empty)."""
    return _STREAM_FOR.get(request, ())


def _validate_control(message: Any) -> None:
    """Checks on handshake values that HMAC and limits rely on (lengths, ranges)."""
    problem: str | None = None
    match message:
        case Hello(versions=versions, user=user, client_nonce=nonce):
            if not versions or not all(0 < v < 256 for v in versions):
                problem = "Hello.versions must list protocol versions between 1 and 255"
            elif not user or len(user.encode()) > MAX_USER_BYTES:
                problem = f"Hello.user must be 1 to {MAX_USER_BYTES} bytes of UTF-8"
            elif len(nonce) != NONCE_SIZE:
                problem = f"Hello.client_nonce must be {NONCE_SIZE} bytes, not {len(nonce)}"
        case Challenge(server_nonce=nonce) if len(nonce) != NONCE_SIZE:
            problem = f"Challenge.server_nonce must be {NONCE_SIZE} bytes, not {len(nonce)}"
        case Auth(mac=mac) | Welcome(server_mac=mac) if len(mac) not in {0, MAC_SIZE}:
            problem = f"a MAC must be {MAC_SIZE} bytes (or empty in open mode), not {len(mac)}"
        case Welcome(max_frame_size=size, max_in_flight=in_flight) if size < 1024 or in_flight < 1:
            problem = "Welcome.max_frame_size must be at least 1024 and max_in_flight at least 1"
        case _:
            pass
    if problem is not None:
        raise RemoteProtocolError(
            ErrorCode.BAD_PAYLOAD, f"{problem[0].upper()}{problem[1:]}; fix the sender."
        )


# -- public coding -----------------------------------------------------------------------------------


def encode_message(message: Message) -> tuple[FrameType, bytes]:
    """Return the frame type that carries ``message`` and its msgpack payload."""
    body: dict[str, Any] = {name: getattr(message, name) for name in fields(message)}
    cls: type[Any] = type(message)
    if cls in _CONTROL.values():
        return cls.FRAME, pack_payload(body)
    if cls in _STREAMED:
        frame_type = FrameType.STREAM
    elif cls in _CHANNEL_INPUT:
        frame_type = FrameType.CHANNEL
    else:
        frame_type = FrameType.REQUEST if cls in _REPLY_FOR else FrameType.REPLY
    return frame_type, pack_payload({"op": cls.OP, **body})


def decode_message(frame_type: FrameType, payload: bytes) -> Message:
    """Decode the payload of a frame of ``frame_type``; raise RemoteProtocolError if it is invalid.

    Only frame types that carry a message are accepted: not CANCEL, PING or PONG (their payload is
    an empty map; check it with :func:`protocol.frames.unpack_payload`).
    """
    body = unpack_payload(payload)
    control = _CONTROL.get(frame_type)
    if control is not None:
        message = build(control, body)
        _validate_control(message)
        return message  # type: ignore[no-any-return]
    by_op = _BY_OP.get(frame_type)
    if by_op is None:
        raise ValueError(f"{frame_type.name} frames carry no message")  # a caller bug, not the peer's
    op = body.get("op")
    if type(op) is not str:
        raise bad_field(f"{frame_type.name}.op", "a string naming the operation", op)
    cls = by_op.get(op)
    if cls is None:
        raise RemoteProtocolError(
            ErrorCode.UNKNOWN_OP,
            f"Op {op[:64]!r} is not a known {frame_type.name} (known: {', '.join(sorted(by_op))}); "
            "the peer may be newer than this side, so upgrade it.",
        )
    return build(cls, body)  # type: ignore[no-any-return]
