"""Requests: what a client asks of the server (REQUEST frames), and its input on a channel it
opened (CHANNEL frames), one frozen record each (protocol/messages.py says what every message
shares; the replies are protocol/replies.py).

One small class per request; codec.py's table says which reply ends each and which stream items
it may send before that (docs/PROTOCOL.md §3).
"""

from typing import Any, ClassVar

from protocol.record import Record

__all__ = [
    "Account",
    "AgentCall",
    "CancelJobs",
    "ChannelAck",
    "ChannelData",
    "ChannelEnd",
    "ChannelResize",
    "CheckObjects",
    "Enqueue",
    "EnqueueBatch",
    "FinishUpload",
    "FollowLogs",
    "ListJobs",
    "ListWorkers",
    "OpenChannel",
    "Ping",
    "PrepareDownload",
    "PrepareUpload",
    "RequeueJobs",
    "ResolveName",
    "ServeJobs",
    "ShowJob",
    "WaitJobs",
    "WatchPool",
]


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
