"""Replies: what the server answers a request with (REPLY frames) and what it streams before that
(STREAM frames), one frozen record each (protocol/messages.py says what every message shares; the
requests are protocol/requests.py).

Each class's docstring names the request it answers; codec.py's table pairs them.
"""

from typing import Any, ClassVar

from protocol.record import Record

__all__ = [
    "Accounted",
    "AgentAnswer",
    "AgentOrder",
    "Cancelled",
    "ChannelClosed",
    "ChannelCredit",
    "ChannelOutput",
    "DownloadTicket",
    "Enqueued",
    "EnqueuedBatch",
    "JobDetail",
    "JobEnded",
    "JobList",
    "LogChunk",
    "LogEnd",
    "ObjectRef",
    "ObjectsHeld",
    "Pong",
    "PoolView",
    "Requeued",
    "Served",
    "UploadTicket",
    "Waited",
    "WatchEnded",
    "WorkerList",
]


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
