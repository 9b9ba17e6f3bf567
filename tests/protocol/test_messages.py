"""Every message round-trips; malformed payloads are refused with a sentence naming the field."""

from typing import Any

import pytest

from protocol import codec
from protocol import messages as m
from protocol import replies as rp
from protocol import requests as rq
from protocol.errors import ErrorCode, RemoteProtocolError
from protocol.frames import FrameType, encode_frame, pack_payload

from .helpers import is_record

NONCE = bytes(range(32))
MAC = bytes(range(32, 64))
JOB = {"id": "{q:default}:01J", "state": "running", "argv": ["python", "train.py"], "env": {"A": "1"}}

EVERY_MESSAGE: list[codec.Message] = [
    m.Hello([1], "alice", NONCE, "poolctl/0.1"),
    m.Hello([1, 2, 7], "ünïcode", NONCE, ""),
    m.Challenge(1, NONCE),
    m.Auth(MAC),
    m.Auth(b""),
    m.Welcome("alice", "pool-1", 16 * 1024 * 1024, 64, MAC),
    m.ErrorMessage(41, "Job 7 does not exist; check the id with poolctl ls."),
    m.ErrorMessage(999, "a code from the future"),
    m.Goodbye("server shutting down"),
    rq.Enqueue({"argv": ["python", "train.py"], "gpus": 2}, "key-1"),
    rq.Enqueue({}, None),
    rq.EnqueueBatch([{"argv": ["a"]}, {"argv": ["b"]}]),
    rq.EnqueueBatch([]),
    rq.ListJobs("default", "running", include_finished=False, limit=100),
    rq.ListJobs(None, None, include_finished=True, limit=0),
    rq.ShowJob("{q:default}:01J"),
    rq.CancelJobs(["a", "b"]),
    rq.RequeueJobs(["a"]),
    rq.WaitJobs(["a"], 30.5),
    rq.WaitJobs(["a"], None),
    rq.FollowLogs("a", follow=True, offset=""),
    rq.ListWorkers(),
    rq.Ping(),
    rp.Enqueued("a", created=True),
    rp.EnqueuedBatch(["a", "b"]),
    rp.JobList([JOB, JOB]),
    rp.JobDetail(JOB),
    rp.Cancelled({"a": "cancelled", "b": "succeeded"}),
    rp.Requeued({"a": "requeueing", "b": "queued"}),
    rp.Waited([JOB], timed_out=False),
    rp.LogChunk(b"\x00epoch 1 loss 0.3\n\xff", "1712345678-0"),
    rp.JobEnded(JOB),
    rq.WatchPool("default", None, False, 100, 2.0, 0),
    rq.WatchPool(None, "running", True, 10, 0.5, 3),
    rp.PoolView([JOB], [{"id": "w1", "slots": 2}], 1712345678.5),
    rp.WatchEnded(3),
    rp.LogEnd("succeeded", 0),
    rp.LogEnd("lost", None),
    rp.WorkerList([{"name": "gpu-01", "slots": 2}]),
    rp.Pong(1712345678.25),
    rq.PrepareUpload("ab" * 32, 0),
    rq.CheckObjects(["ab" * 32, "cd" * 32]),
    rq.FinishUpload("ab" * 32, "dir", "imagenet"),
    rq.FinishUpload("ab" * 32, "file", None),
    rq.ResolveName("imagenet"),
    rq.PrepareDownload("artifacts/default.1/1/log"),
    rp.UploadTicket("sha256/ab/" + "ab" * 32, exists=True, url=None, local_store=None),
    rp.UploadTicket("k", exists=False, url="http://s3/b/k?X-Amz-Signature=1", local_store=None),
    rp.ObjectRef("imagenet", "ab" * 32, 1024, "dir"),
    rp.ObjectsHeld(["cd" * 32]),
    rp.DownloadTicket("k", 5, None, None, "/var/lib/gpupool/store"),
    rq.ServeJobs(
        2,
        ["default"],
        [{"index": 0, "uuid": "GPU-1", "name": "H100", "memory": 80 << 30}],
        0.0,
        "gpu-01",
        True,
        {"pid": 7, "batch_job": "slurm:12"},
        4.0,
        2.0,
    ),
    rp.AgentOrder("run", "w/1.0", {"slot": 0, "gpus": ["GPU-1"], "valid_for": 20.0}),
    rp.Served("the pool server is stopping"),
    rq.AgentCall("w", b"\x00" * 32, "w/1.0", "append_log", {"number": 1, "chunks": [b"hi\n"]}),
    rp.AgentAnswer({}),
    rq.OpenChannel("default.1", "exec", ["sh", "-c", "echo hi"], stdin=True),
    rp.ChannelOutput("stderr", b"\x00oops\n"),
    rp.ChannelCredit(4096),
    rp.ChannelClosed(3, "exited"),
    rp.ChannelClosed(None, "the job ended"),
    rq.ChannelData(b"hi\n"),
    rq.ChannelEnd(),
    rq.ChannelAck(65536),
    rq.ChannelResize(50, 132),
    rq.OpenChannel("default.1", "attach", [], stdin=True, rows=24, cols=80),
    rq.Account("alice", "default", 1712345678.0, None, "day"),
    rq.Account(None, None, None, None, "user"),
    rp.Accounted(
        [{"user": "alice", "jobs": 2, "gpu_hours": 1.5, "efficiency": None, "wait_p50": 3.0}],
        {"jobs": 2, "gpu_hours": 1.5, "efficiency": None, "wait_p50": 3.0},
        1712345678.0,
        1712349999.5,
    ),
]


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=repr)
def test_round_trip(message: codec.Message) -> None:
    frame_type, payload = codec.encode_message(message)
    assert codec.decode_message(frame_type, payload) == message


def test_every_message_class_is_covered() -> None:
    defined = {cls for module in (m, rq, rp) for cls in vars(module).values() if is_record(cls)}
    assert {type(message) for message in EVERY_MESSAGE} == defined
    assert len(defined) == 6 + 20 + 19 + 6 + 4  # control, requests, replies, stream items, channel input


def test_frame_types() -> None:
    assert codec.encode_message(rq.Ping())[0] is FrameType.REQUEST
    assert codec.encode_message(rp.Pong(1.0))[0] is FrameType.REPLY
    assert codec.encode_message(rp.LogChunk(b"", ""))[0] is FrameType.STREAM
    assert codec.encode_message(rp.LogEnd("x", None))[0] is FrameType.REPLY
    assert codec.encode_message(m.Goodbye(""))[0] is FrameType.GOODBYE
    assert codec.encode_message(rq.ChannelData(b""))[0] is FrameType.CHANNEL


def test_op_names_are_on_the_wire() -> None:
    _, payload = codec.encode_message(rq.ShowJob("j"))
    assert payload == pack_payload({"op": "show_job", "job_id": "j"})


def test_messages_are_frozen_and_slotted() -> None:
    message = rq.ShowJob("j")
    with pytest.raises(AttributeError):
        message.job_id = "k"  # type: ignore[misc]
    assert not hasattr(message, "__dict__")


def test_reply_and_stream_types() -> None:
    assert codec.reply_type(rq.FollowLogs) is rp.LogEnd
    assert codec.stream_type(rq.FollowLogs) == (rp.LogChunk,)
    assert codec.stream_type(rq.WaitJobs) == (rp.JobEnded,)
    assert codec.stream_type(rq.WatchPool) == (rp.PoolView,)
    assert codec.stream_type(rq.OpenChannel) == (rp.ChannelOutput, rp.ChannelCredit)
    assert codec.stream_type(rq.Enqueue) == ()


def test_unknown_keys_are_ignored() -> None:
    payload = pack_payload({"op": "show_job", "job_id": "j", "added_in_v1_1": [1, 2]})
    assert codec.decode_message(FrameType.REQUEST, payload) == rq.ShowJob("j")


def test_float_fields_accept_integers() -> None:
    payload = pack_payload({"op": "wait_jobs", "job_ids": [], "timeout": 3})
    decoded = codec.decode_message(FrameType.REQUEST, payload)
    assert decoded == rq.WaitJobs([], 3.0)
    assert isinstance(decoded, rq.WaitJobs)
    assert type(decoded.timeout) is float


def reject(frame_type: FrameType, body: dict[str, Any], code: ErrorCode = ErrorCode.BAD_PAYLOAD) -> str:
    with pytest.raises(RemoteProtocolError) as caught:
        codec.decode_message(frame_type, pack_payload(body))
    assert caught.value.code is code
    return caught.value.message


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"op": "show_job"}, "show_job.job_id"),
        ({"op": "show_job", "job_id": 7}, "show_job.job_id"),
        ({"op": "show_job", "job_id": b"7"}, "show_job.job_id"),
        ({"op": "show_job", "job_id": None}, "show_job.job_id"),
        ({"op": "cancel_jobs", "job_ids": "a"}, "cancel_jobs.job_ids"),
        ({"op": "cancel_jobs", "job_ids": ["a", 1]}, "cancel_jobs.job_ids[1]"),
        ({"op": "enqueue", "spec": [], "idempotency_key": None}, "enqueue.spec"),
        ({"op": "enqueue", "spec": {}, "idempotency_key": 5}, "enqueue.idempotency_key"),
        ({"op": "enqueue_batch", "specs": [{}, 1]}, "enqueue_batch.specs[1]"),
        (
            {"op": "list_jobs", "queue": None, "state": None, "include_finished": 1, "limit": 5},
            "include_finished",
        ),
        ({"op": "list_jobs", "queue": None, "state": None, "include_finished": True, "limit": True}, "limit"),
        ({"op": "list_jobs", "queue": None, "state": None, "include_finished": True, "limit": 1.0}, "limit"),
        ({"op": "wait_jobs", "job_ids": [], "timeout": "1"}, "wait_jobs.timeout"),
        ({"op": "wait_jobs", "job_ids": [], "timeout": float("nan")}, "wait_jobs.timeout"),
        ({"op": "wait_jobs", "job_ids": [], "timeout": float("inf")}, "wait_jobs.timeout"),
        ({"op": "wait_jobs", "job_ids": [], "timeout": False}, "wait_jobs.timeout"),
        ({"op": "follow_logs", "job_id": "a", "follow": "yes", "offset": ""}, "follow_logs.follow"),
    ],
)
def test_wrong_request_fields(body: dict[str, Any], field: str) -> None:
    message = reject(FrameType.REQUEST, body)
    assert field in message
    assert message.endswith(".")


@pytest.mark.parametrize(
    ("frame_type", "body", "field"),
    [
        (FrameType.REPLY, {"op": "cancelled", "states": {"a": 1}}, "cancelled.states['a']"),
        (FrameType.REPLY, {"op": "log_end", "state": "x"}, "log_end.exit_code"),
        (FrameType.REPLY, {"op": "log_end", "state": "x", "exit_code": 1.0}, "log_end.exit_code"),
        (FrameType.STREAM, {"op": "log_chunk", "data": "text", "offset": ""}, "log_chunk.data"),
        (FrameType.HELLO, {"versions": [1], "user": "a", "client_nonce": NONCE}, "Hello.client"),
        (FrameType.ERROR, {"code": "41", "message": "x"}, "ErrorMessage.code"),
    ],
)
def test_wrong_other_fields(frame_type: FrameType, body: dict[str, Any], field: str) -> None:
    assert field in reject(frame_type, body)


@pytest.mark.parametrize(
    "body",
    [
        {"versions": [], "user": "a", "client_nonce": NONCE, "client": ""},
        {"versions": [0], "user": "a", "client_nonce": NONCE, "client": ""},
        {"versions": [256], "user": "a", "client_nonce": NONCE, "client": ""},
        {"versions": [1], "user": "", "client_nonce": NONCE, "client": ""},
        {"versions": [1], "user": "u" * 256, "client_nonce": NONCE, "client": ""},
        {"versions": [1], "user": "a", "client_nonce": NONCE[:31], "client": ""},
    ],
)
def test_hello_values_checked(body: dict[str, Any]) -> None:
    reject(FrameType.HELLO, body)


def test_handshake_values_checked() -> None:
    reject(FrameType.CHALLENGE, {"version": 1, "server_nonce": b"short"})
    reject(FrameType.AUTH, {"mac": b"x" * 31})
    welcome = {"user": "a", "server": "s", "max_frame_size": 1 << 20, "max_in_flight": 4, "server_mac": b""}
    assert codec.decode_message(FrameType.WELCOME, pack_payload(welcome)) == m.Welcome(
        "a", "s", 1 << 20, 4, b""
    )
    reject(FrameType.WELCOME, {**welcome, "max_in_flight": 0})
    reject(FrameType.WELCOME, {**welcome, "max_frame_size": 10})
    reject(FrameType.WELCOME, {**welcome, "server_mac": b"x"})


def test_op_dispatch_errors() -> None:
    assert "REQUEST.op" in reject(FrameType.REQUEST, {"job_id": "a"})
    assert "REQUEST.op" in reject(FrameType.REQUEST, {"op": 1})
    message = reject(FrameType.REQUEST, {"op": "rm_rf"}, ErrorCode.UNKNOWN_OP)
    assert "'rm_rf'" in message
    assert "show_job" in message  # the sentence lists what is known
    # A reply op is not a request, and a request op is not a reply.
    reject(FrameType.REQUEST, {"op": "pong", "server_time": 1.0}, ErrorCode.UNKNOWN_OP)
    reject(FrameType.REPLY, {"op": "ping"}, ErrorCode.UNKNOWN_OP)
    reject(FrameType.REPLY, {"op": "log_chunk", "data": b"", "offset": ""}, ErrorCode.UNKNOWN_OP)
    reject(FrameType.STREAM, {"op": "log_end", "state": "x", "exit_code": None}, ErrorCode.UNKNOWN_OP)


def test_frames_without_messages() -> None:
    with pytest.raises(ValueError, match="carry no message"):
        codec.decode_message(FrameType.PING, pack_payload({}))


def test_documented_hello_dump() -> None:
    # The hex dump in docs/PROTOCOL.md §8: keep the two in step.
    frame_type, payload = codec.encode_message(m.Hello([1], "alice", bytes(range(32)), "poolctl/0.1"))
    dump = (
        "47 50 01 01 00 00 00 00 00 00 00 00 00 59 84 a8 76 65 72 73 69 6f 6e 73 91 01 a4 75 73 65 72 a5"
        " 61 6c 69 63 65 ac 63 6c 69 65 6e 74 5f 6e 6f 6e 63 65 c4 20 00 01 02 03 04 05 06 07 08 09 0a 0b"
        " 0c 0d 0e 0f 10 11 12 13 14 15 16 17 18 19 1a 1b 1c 1d 1e 1f a6 63 6c 69 65 6e 74 ab 70 6f 6f 6c"
        " 63 74 6c 2f 30 2e 31"
    )
    assert encode_frame(frame_type, 0, payload) == bytes.fromhex(dump)


def test_documented_request_dump() -> None:
    frame_type, payload = codec.encode_message(rq.ShowJob("j1"))
    dump = (
        "47 50 01 10 00 00 00 00 00 01 00 00 00 17"  # header
        " 82 a2 6f 70 a8 73 68 6f 77 5f 6a 6f 62 a6 6a 6f 62 5f 69 64 a2 6a 31"  # payload
    )
    assert encode_frame(frame_type, 1, payload) == bytes.fromhex(dump)
