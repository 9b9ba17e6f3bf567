"""Messages: one frozen record (protocol/record.py) per payload; protocol/codec.py (de)codes them.

Handshake, ERROR and GOODBYE frames carry one fixed message type each. REQUEST, REPLY and STREAM
frames carry a map whose ``"op"`` string names the message; decoding dispatches on it. Every field
is required (``None`` is sent as nil where the type allows it), but for a field a later version
added, which has a default: a sender that predates it leaves it out and means the default; keys a
receiver does not know are ignored, which is how later versions can add fields. A field of the
wrong type is a BAD_PAYLOAD protocol error naming the field: types are checked here, meaning (is
that job id real? is the spec valid?) is the daemon's business.

Job specs, jobs and workers are ``dict[str, Any]`` here; the daemon owns their schema.

Over ~400 lines on purpose: it is the wire's whole vocabulary, one small class per message, and a
reader of docs/PROTOCOL.md §3 wants them in one place (the table that decodes them: codec.py).
"""

from typing import Any, ClassVar, Final

from protocol.frames import FrameType
from protocol.record import Record

__all__ = [
    "CHANNEL_WINDOW",
    "NONCE_SIZE",
    "Account",
    "Accounted",
    "AgentAnswer",
    "AgentCall",
    "AgentOrder",
    "Auth",
    "CancelJobs",
    "Cancelled",
    "Challenge",
    "ChannelAck",
    "ChannelClosed",
    "ChannelCredit",
    "ChannelData",
    "ChannelEnd",
    "ChannelOutput",
    "ChannelResize",
    "CheckObjects",
    "DownloadTicket",
    "Enqueue",
    "EnqueueBatch",
    "Enqueued",
    "EnqueuedBatch",
    "ErrorMessage",
    "FinishUpload",
    "FollowLogs",
    "Goodbye",
    "Hello",
    "JobDetail",
    "JobEnded",
    "JobList",
    "ListJobs",
    "ListWorkers",
    "LogChunk",
    "LogEnd",
    "ObjectRef",
    "ObjectsHeld",
    "OpenChannel",
    "Ping",
    "Pong",
    "PoolView",
    "PrepareDownload",
    "PrepareUpload",
    "RequeueJobs",
    "Requeued",
    "ResolveName",
    "ServeJobs",
    "Served",
    "ShowJob",
    "UploadTicket",
    "WaitJobs",
    "Waited",
    "WatchEnded",
    "WatchPool",
    "Welcome",
    "WorkerList",
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


# -- requests ----------------------------------------------------------------------------------------


class Enqueue(Record):
    """Submit one job; the same idempotency key always yields the same job id."""

    OP: ClassVar = "enqueue"
    spec: dict[str, Any]
    idempotency_key: str | None


class EnqueueBatch(Record):
    """Submit several jobs at once, in order."""

    OP: ClassVar = "enqueue_batch"
    specs: list[dict[str, Any]]


class ListJobs(Record):
    """List jobs, optionally filtered by queue, state, user and name (a glob, of the name `ls`
    shows). ``user`` and ``name`` came later: a server that predates them ignores them, and its
    reply's ``filtered`` says so."""

    OP: ClassVar = "list_jobs"
    queue: str | None
    state: str | None
    include_finished: bool
    limit: int
    user: str | None = None
    name: str | None = None
    reasons: bool = False  # each queued job's pending_reason too (`ls --format ...,reason`)


class ShowJob(Record):
    """Everything known about one job."""

    OP: ClassVar = "show_job"
    job_id: str


class CancelJobs(Record):
    """Cancel jobs by id."""

    OP: ClassVar = "cancel_jobs"
    job_ids: list[str]


class RequeueJobs(Record):
    """Put running jobs back at the front of their queues: each is stopped (SIGTERM, then SIGKILL
    after the worker's grace) and runs again, under the same id, with its attempt number + 1."""

    OP: ClassVar = "requeue_jobs"
    job_ids: list[str]


class WaitJobs(Record):
    """Wait until every job is terminal, or ``timeout`` seconds pass (None: no limit); each job
    is streamed as a JobEnded as it ends (one that had ended already, at once)."""

    OP: ClassVar = "wait_jobs"
    job_ids: list[str]
    timeout: float | None


class WatchPool(Record):
    """A live view of the pool: a PoolView streamed every ``interval`` seconds (the server may
    space them more) with the jobs ListJobs would list, until cancelled, or ``count`` views have
    been sent (0: no end)."""

    OP: ClassVar = "watch_pool"
    queue: str | None
    state: str | None
    include_finished: bool
    limit: int
    interval: float
    count: int
    user: str | None = None  # (as ListJobs)
    name: str | None = None
    reasons: bool = False


class FollowLogs(Record):
    """Stream a job's log from ``offset`` (opaque, "" = start); with ``follow``, until it ends."""

    OP: ClassVar = "follow_logs"
    job_id: str
    follow: bool
    offset: str


class ListWorkers(Record):
    """List workers and their slots."""

    OP: ClassVar = "list_workers"


class Account(Record):
    """What the jobs that ended between ``since`` and ``until`` (Unix seconds; None: 30 days ago,
    and now) used, from their accounting records, summed per ``by`` ("user", "queue" or "day"),
    for ``user``'s jobs (None: every user's a caller may see: an admin's, everyone's; anyone
    else's, their own) in ``queue`` (None: every queue)."""

    OP: ClassVar = "account"
    user: str | None
    queue: str | None
    since: float | None
    until: float | None
    by: str


class Ping(Record):
    """An application-level round trip (the PING frame is the transport-level one)."""

    OP: ClassVar = "ping"


class PrepareUpload(Record):
    """Ask to store a content-addressed object of ``size`` bytes hashing to ``sha256``.

    The server authorises and hands out where to send the bytes (UploadTicket); the bytes never
    pass through it.
    """

    OP: ClassVar = "prepare_upload"
    sha256: str
    size: int


class CheckObjects(Record):
    """Which of these content-addressed objects the caller has stored already (a project's packs,
    asked about at once): those need neither PrepareUpload nor FinishUpload again."""

    OP: ClassVar = "check_objects"
    sha256s: list[str]


class FinishUpload(Record):
    """The bytes of ``sha256`` are stored: the server checks the object and records it, under
    ``name`` too when one is given. ``kind`` is ``file`` or ``dir`` (a tar of a directory)."""

    OP: ClassVar = "finish_upload"
    sha256: str
    kind: str
    name: str | None


class ResolveName(Record):
    """What the dataset ``name`` (from FinishUpload) is."""

    OP: ClassVar = "resolve_name"
    name: str


class PrepareDownload(Record):
    """Ask where to fetch the object ``key`` (a dataset or an artifact) from."""

    OP: ClassVar = "prepare_download"
    key: str


class ServeJobs(Record):
    """An agent worker offers its machine: ``slots`` job slots taking ``queues``, with ``gpus``
    (one map per GPU: index, uuid, name, memory in bytes), leaving by ``leave_by`` (Unix seconds;
    0: never), on ``host``. The server runs a worker for it, which makes every fenced write
    (claims, renewals, outcomes) and streams AgentOrder items, what to run and stop, until that
    worker has stopped; then it replies Served. An agent serves the jobs its user may act on;
    with ``shared_uid`` (its jobs run as its own uid, and so may read its token) its user's only.
    ``machine``: what `poolctl workers` shows of it (pid, cpus, memory, batch_job; each optional).
    ``drain_timeout`` and ``kill_grace`` are the agent's own: its worker takes the shorter of each
    and the server's (a pilot reckons its lifetime with its own)."""

    OP: ClassVar = "serve_jobs"
    slots: int
    queues: list[str]
    gpus: list[dict[str, Any]]
    leave_by: float
    host: str
    shared_uid: bool
    machine: dict[str, Any]
    drain_timeout: float
    kill_grace: float


class AgentCall(Record):
    """An agent's news of, or write for, one attempt it runs (``lease_id``; "" for the agent as a
    whole): ``call`` names it, ``args`` are its arguments (docs/PROTOCOL.md §3.4). ``worker`` and
    ``key`` are the ones its ServeJobs stream's first order gave it: only that stream's agent may
    call for its attempts."""

    OP: ClassVar = "agent_call"
    worker: str
    key: bytes
    lease_id: str
    call: str
    args: dict[str, Any]


class OpenChannel(Record):
    """Open a bidirectional channel into running job ``job_id``: ``kind`` "exec" runs ``argv``
    in the job's allocation; "forward" (``argv`` empty, ``stdin`` True) connects to 127.0.0.1:
    ``port`` as the job sees it; "attach" (``argv`` empty, ``stdin`` True) attaches to the
    terminal of a tty job (`poolctl shell`), its window ``rows`` x ``cols`` (0: as it is). Its
    output comes back as ChannelOutput items, the credit for the client's input as ChannelCredit
    items, its end as ChannelClosed; the client sends its input on the same request id in
    CHANNEL frames (ChannelData, ChannelEnd, ChannelAck, ChannelResize). ``stdin``
    False: the command's stdin is empty, and ChannelData is refused."""

    OP: ClassVar = "open_channel"
    job_id: str
    kind: str
    argv: list[str]
    stdin: bool
    port: int = 0  # a forward's
    rows: int = 0  # an attach's window (ChannelResize changes it later)
    cols: int = 0


# -- channel input (CHANNEL frames, client → server, on an open channel's request id) ---------------


class ChannelData(Record):
    """Bytes for the channel's far end (an exec's stdin): at most the window's room."""

    OP: ClassVar = "channel_data"
    data: bytes


class ChannelEnd(Record):
    """No more data from the client (an exec's stdin reaches its end); nothing may follow."""

    OP: ClassVar = "channel_end"


class ChannelResize(Record):
    """The client's terminal is now ``rows`` x ``cols`` (1 to 65535 each): an attach's terminal
    takes that size (channels of other kinds ignore it). Not data: no window counts it, and it
    may come after ChannelEnd."""

    OP: ClassVar = "channel_resize"
    rows: int
    cols: int


class ChannelAck(Record):
    """The client has taken ``size`` more bytes of ChannelOutput: the server may send as many again."""

    OP: ClassVar = "channel_ack"
    size: int


# -- replies and stream items ------------------------------------------------------------------------


class Enqueued(Record):
    """Reply to Enqueue; ``created`` is False when the idempotency key matched an earlier job."""

    OP: ClassVar = "enqueued"
    job_id: str
    created: bool


class EnqueuedBatch(Record):
    """Reply to EnqueueBatch: the job ids, in the order of the specs."""

    OP: ClassVar = "enqueued_batch"
    job_ids: list[str]


class JobList(Record):
    """Reply to ListJobs. ``filtered``: the server applied ``user`` and ``name`` (one that predates
    them leaves it out, which reads as false)."""

    OP: ClassVar = "job_list"
    jobs: list[dict[str, Any]]
    filtered: bool = False


class JobDetail(Record):
    """Reply to ShowJob."""

    OP: ClassVar = "job_detail"
    job: dict[str, Any]


class Cancelled(Record):
    """Reply to CancelJobs: job id → its state after the cancel."""

    OP: ClassVar = "cancelled"
    states: dict[str, str]


class Requeued(Record):
    """Reply to RequeueJobs: job id → "requeueing" (it is being stopped and goes back to the
    front), or why not: its state (queued: it has not started; or how it ended), "not_found",
    "not_yours"."""

    OP: ClassVar = "requeued"
    states: dict[str, str]


class Waited(Record):
    """Reply to WaitJobs: the jobs as they are now, and whether the timeout cut the wait short."""

    OP: ClassVar = "waited"
    jobs: list[dict[str, Any]]
    timed_out: bool


class LogChunk(Record):
    """STREAM item of FollowLogs: log bytes, and the offset to resume after them."""

    OP: ClassVar = "log_chunk"
    data: bytes
    offset: str


class JobEnded(Record):
    """STREAM item of WaitJobs: one of the jobs waited for, as it ended."""

    OP: ClassVar = "job_ended"
    job: dict[str, Any]


class PoolView(Record):
    """STREAM item of WatchPool: the pool at time ``at``: jobs as ListJobs, workers as ListWorkers."""

    OP: ClassVar = "pool_view"
    jobs: list[dict[str, Any]]
    workers: list[dict[str, Any]]
    at: float
    filtered: bool = False  # (as JobList)


class ChannelOutput(Record):
    """STREAM item of OpenChannel: bytes the far end wrote on ``stream`` ("stdout" or "stderr";
    a forward's connection: "stdout")."""

    OP: ClassVar = "channel_output"
    stream: str
    data: bytes


class ChannelCredit(Record):
    """STREAM item of OpenChannel: the far end has taken ``size`` more bytes of the client's
    ChannelData: the client may send as many again."""

    OP: ClassVar = "channel_credit"
    size: int


class ChannelClosed(Record):
    """Final reply of OpenChannel: the far end has ended; ``exit_code`` is an exec's (None when it
    never ran or was killed without one), ``reason`` says how it ended."""

    OP: ClassVar = "channel_closed"
    exit_code: int | None
    reason: str


class WatchEnded(Record):
    """Final reply of WatchPool, once ``count`` views have been sent."""

    OP: ClassVar = "watch_ended"
    views: int


class LogEnd(Record):
    """Final reply of FollowLogs: the job's state when the log ended (exit code if it has one)."""

    OP: ClassVar = "log_end"
    state: str
    exit_code: int | None


class WorkerList(Record):
    """Reply to ListWorkers."""

    OP: ClassVar = "worker_list"
    workers: list[dict[str, Any]]


class Accounted(Record):
    """Reply to Account: one row per group (its key under the name ``by`` gave, then ``jobs``,
    ``failed``, ``cancelled``, ``gpu_hours``, ``cpu_hours``, ``efficiency`` (nil where no job of
    the group had its GPU use recorded), ``wait_p50`` and ``wait_p90`` (seconds; nil where none
    ran)), in the order of their keys; ``total``, the same over every row; and the times it
    covered."""

    OP: ClassVar = "accounted"
    rows: list[dict[str, Any]]
    total: dict[str, Any]
    since: float
    until: float


class Pong(Record):
    """Reply to Ping: the server's clock (Unix seconds)."""

    OP: ClassVar = "pong"
    server_time: float


class UploadTicket(Record):
    """Reply to PrepareUpload. ``exists``: the object is already stored, send nothing. Otherwise
    either ``url`` (a presigned PUT; send header ``x-amz-meta-sha256: <sha256>``) or
    ``local_store`` (the directory of a local store on the server's machine) is set."""

    OP: ClassVar = "upload_ticket"
    key: str
    exists: bool
    url: str | None
    local_store: str | None


class ObjectsHeld(Record):
    """Reply to CheckObjects: those of the objects asked about that are stored and recorded as the
    caller's upload, in the order asked."""

    OP: ClassVar = "objects_held"
    sha256s: list[str]


class ObjectRef(Record):
    """Reply to FinishUpload and ResolveName: a stored object and the name it goes by."""

    OP: ClassVar = "object_ref"
    name: str | None
    sha256: str
    size: int
    kind: str


class DownloadTicket(Record):
    """Reply to PrepareDownload: the object's size and sha256 (to verify what arrives), and
    either a presigned GET ``url`` or the ``local_store`` directory to read it from."""

    OP: ClassVar = "download_ticket"
    key: str
    size: int
    sha256: str | None
    url: str | None
    local_store: str | None


class AgentOrder(Record):
    """STREAM item of ServeJobs: what the agent's worker asks of it (``act``), for one attempt
    (``lease_id``; "" for the agent as a whole), with ``detail`` (docs/PROTOCOL.md §3.4)."""

    OP: ClassVar = "agent_order"
    act: str
    lease_id: str
    detail: dict[str, Any]


class Served(Record):
    """Final reply of ServeJobs: the agent's worker has stopped (``reason`` says why), and the
    agent holds no attempt any more."""

    OP: ClassVar = "served"
    reason: str


class AgentAnswer(Record):
    """Reply to AgentCall: what the call answers (docs/PROTOCOL.md §3.4; {} for most)."""

    OP: ClassVar = "agent_answer"
    value: dict[str, Any]
