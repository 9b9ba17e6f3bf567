"""Requests, streaming, cancel, limits and shutdown over a connected pair, with no event loop."""

import pytest

from protocol import (
    Account,
    Accounted,
    CancelJobs,
    Cancelled,
    CancelRequested,
    ClientConnection,
    ConnectionClosed,
    ConnectionFailed,
    DecodeNeeded,
    ErrorCode,
    FollowLogs,
    GoodbyeReceived,
    JobDetail,
    JobList,
    ListJobs,
    LocalProtocolError,
    LogChunk,
    LogEnd,
    Ping,
    Pong,
    PongReceived,
    ReplyReceived,
    RequestFailed,
    RequestReceived,
    ShowJob,
    State,
)
from protocol.codec import decode_message
from protocol.errors import RemoteProtocolError
from protocol.frames import MAX_REQUEST_ID, FrameType

from .helpers import HELLO, NONCE, Pair, assert_server_failed, drain, fatal_error, raw_frame

# -- requests ------------------------------------------------------------------------------------------


def test_request_and_reply() -> None:
    pair = Pair().connect()
    request_id = pair.request(ShowJob("j1"))
    assert pair.server.in_flight == pair.client.in_flight == {request_id}
    data = pair.server.reply(request_id, JobDetail({"id": "j1"}))
    assert pair.to_client(data) == [ReplyReceived(request_id, JobDetail({"id": "j1"}), final=True)]
    assert pair.server.in_flight == pair.client.in_flight == frozenset()


def test_a_large_request_is_handed_out_to_be_decoded_and_nothing_comes_before_it() -> None:
    pair = Pair(decode_inline=1000).connect()
    big = CancelJobs([f"default.{i:012d}" for i in range(200)])
    big_id, data = pair.client.request(big)
    small_id, more = pair.client.request(Ping())
    pair.server.receive_data(data + more)
    event = pair.server.next_event()
    assert isinstance(event, DecodeNeeded)
    assert event.request_id == big_id
    with pytest.raises(LocalProtocolError):
        pair.server.next_event()  # the Ping behind it waits
    message = decode_message(FrameType.REQUEST, event.payload)  # wherever the caller likes
    assert pair.server.decoded(big_id, message) == RequestReceived(big_id, big)
    assert drain(pair.server) == [RequestReceived(small_id, Ping())]
    assert pair.server.in_flight == {big_id, small_id}


def test_a_large_request_that_does_not_decode_fails_the_connection_as_a_small_one_does() -> None:
    pair = Pair(decode_inline=10).connect()
    pair.server.receive_data(
        raw_frame(FrameType.REQUEST, 1, {"op": "cancel_jobs", "job_ids": 7, "x": "y" * 20})
    )
    event = pair.server.next_event()
    assert isinstance(event, DecodeNeeded)
    with pytest.raises(RemoteProtocolError) as caught:
        decode_message(FrameType.REQUEST, event.payload)
    failed = pair.server.decoded(1, caught.value)
    assert isinstance(failed, ConnectionFailed)
    assert_server_failed(pair, [failed], caught.value.code)


@pytest.mark.parametrize("frame_type", [FrameType.PING, FrameType.PONG, FrameType.CANCEL, FrameType.GOODBYE])
def test_a_control_frame_may_not_be_large(frame_type: FrameType) -> None:
    """Only requests and replies carry much; a control frame of megabytes would be decoded on the
    server's event loop (~2 s for 16 MiB of tiny items): refused from its size alone."""
    pair = Pair().connect()
    request_id = 0 if frame_type is FrameType.GOODBYE else 1
    events = pair.to_server(raw_frame(frame_type, request_id, {"x": [0] * 5000}))
    assert_server_failed(pair, events, ErrorCode.FRAME_TOO_LARGE)


def test_requests_are_multiplexed() -> None:
    pair = Pair().connect()
    first = pair.request(Ping())
    second = pair.request(ListJobs(None, None, include_finished=False, limit=10))
    assert first != second
    data = pair.server.reply(second, JobList([])) + pair.server.reply(first, Pong(5.0))
    assert pair.to_client(data) == [
        ReplyReceived(second, JobList([]), final=True),
        ReplyReceived(first, Pong(5.0), final=True),
    ]


def test_request_level_error_is_not_fatal() -> None:
    pair = Pair().connect()
    request_id = pair.request(ShowJob("nope"))
    data = pair.server.error(request_id, ErrorCode.NOT_FOUND, "Job nope does not exist.")
    assert pair.to_client(data) == [
        RequestFailed(request_id, ErrorCode.NOT_FOUND, "Job nope does not exist.")
    ]
    assert pair.server.state is pair.client.state is State.READY
    pair.request(Ping())  # the connection carries on


def test_unknown_error_code_is_kept() -> None:
    pair = Pair().connect()
    request_id = pair.request(Ping())
    events = pair.to_client(raw_frame(FrameType.ERROR, request_id, {"code": 77, "message": "new"}))
    assert events == [RequestFailed(request_id, 77, "new")]


def test_streaming_then_final_reply() -> None:
    pair = Pair().connect()
    request_id = pair.request(FollowLogs("j1", follow=True, offset=""))
    chunks = [LogChunk(f"line {n}\n".encode(), str(n)) for n in range(3)]
    data = b"".join(pair.server.stream(request_id, chunk) for chunk in chunks)
    assert pair.to_client(data) == [ReplyReceived(request_id, chunk, final=False) for chunk in chunks]
    assert pair.client.in_flight == pair.server.in_flight == {request_id}  # STREAM does not end it
    end = LogEnd("succeeded", 0)
    assert pair.to_client(pair.server.reply(request_id, end)) == [ReplyReceived(request_id, end, final=True)]
    assert pair.client.in_flight == pair.server.in_flight == frozenset()


def test_cancel() -> None:
    pair = Pair().connect()
    request_id = pair.request(FollowLogs("j1", follow=True, offset=""))
    pair.to_client(pair.server.stream(request_id, LogChunk(b"x", "1")))
    assert pair.to_server(pair.client.cancel(request_id)) == [CancelRequested(request_id)]
    assert pair.to_server(pair.client.cancel(request_id)) == []  # told once is enough
    # A stream item already on its way is still legal; then the server ends the request.
    data = pair.server.stream(request_id, LogChunk(b"y", "2"))
    data += pair.server.error(request_id, ErrorCode.CANCELLED, "Cancelled by the client.")
    events = pair.to_client(data)
    assert events[-1] == RequestFailed(request_id, ErrorCode.CANCELLED, "Cancelled by the client.")
    assert pair.client.cancel(request_id) == b""  # nothing left to cancel


def test_cancel_that_crossed_the_reply_is_ignored() -> None:
    pair = Pair().connect()
    request_id = pair.request(CancelJobs(["a"]))
    cancel = pair.client.cancel(request_id)
    reply = pair.server.reply(request_id, Cancelled({"a": "cancelled"}))
    assert pair.to_server(cancel) == []
    assert pair.to_client(reply) == [ReplyReceived(request_id, Cancelled({"a": "cancelled"}), final=True)]


def test_duplicate_request_id() -> None:
    pair = Pair().connect()
    request_id = pair.request(Ping())
    events = pair.to_server(raw_frame(FrameType.REQUEST, request_id, {"op": "ping"}))
    assert_server_failed(pair, events, ErrorCode.DUPLICATE_REQUEST_ID)


def test_request_id_can_be_reused_once_finished() -> None:
    pair = Pair().connect()
    request_id = pair.request(Ping())
    pair.to_client(pair.server.reply(request_id, Pong(1.0)))
    assert pair.to_server(raw_frame(FrameType.REQUEST, request_id, {"op": "ping"})) == [
        RequestReceived(request_id, Ping())
    ]


def test_max_in_flight() -> None:
    pair = Pair(max_in_flight=2).connect()
    pair.request(Ping())
    pair.request(Ping())
    with pytest.raises(LocalProtocolError) as caught:
        pair.client.request(Ping())  # the client knows the limit from WELCOME
    assert caught.value.code is ErrorCode.TOO_MANY_REQUESTS
    events = pair.to_server(raw_frame(FrameType.REQUEST, 99, {"op": "ping"}))
    assert_server_failed(pair, events, ErrorCode.TOO_MANY_REQUESTS)


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"\x92\x01\x02", ErrorCode.BAD_PAYLOAD),  # not a map
        (b"\x81\xa2op", ErrorCode.BAD_PAYLOAD),  # truncated msgpack
        ({"op": "rm_rf"}, ErrorCode.UNKNOWN_OP),
        ({"op": "pong", "server_time": 1.0}, ErrorCode.UNKNOWN_OP),  # a reply op in a request
        ({"op": "show_job", "job_id": 7}, ErrorCode.BAD_PAYLOAD),
        ({"op": "show_job"}, ErrorCode.BAD_PAYLOAD),
    ],
)
def test_malformed_requests_are_fatal(payload: dict[str, object] | bytes, code: ErrorCode) -> None:
    pair = Pair().connect()
    assert_server_failed(pair, pair.to_server(raw_frame(FrameType.REQUEST, 1, payload)), code)


@pytest.mark.parametrize(
    "frame",
    [
        raw_frame(FrameType.HELLO, 0, HELLO),
        raw_frame(FrameType.REPLY, 1, {"op": "pong", "server_time": 1.0}),
        raw_frame(FrameType.STREAM, 1, {"op": "log_chunk", "data": b"", "offset": ""}),
        raw_frame(FrameType.ERROR, 1, {"code": 41, "message": "x"}),
        raw_frame(FrameType.CHALLENGE, 0, {"version": 1, "server_nonce": NONCE}),
    ],
)
def test_frames_a_client_may_not_send(frame: bytes) -> None:
    pair = Pair().connect()
    assert_server_failed(pair, pair.to_server(frame), ErrorCode.UNEXPECTED_FRAME)


def test_server_checks_its_own_answers() -> None:
    pair = Pair().connect()
    request_id = pair.request(ShowJob("j"))
    with pytest.raises(LocalProtocolError):
        pair.server.reply(request_id, Pong(1.0))  # wrong reply type
    with pytest.raises(LocalProtocolError):
        pair.server.stream(request_id, LogChunk(b"", ""))  # ShowJob does not stream
    with pytest.raises(LocalProtocolError):
        pair.server.reply(request_id + 1, JobDetail({}))  # not in flight
    with pytest.raises(LocalProtocolError) as caught:
        pair.server.reply(request_id, JobDetail({"blob": b"x" * (17 * 1024 * 1024)}))
    assert caught.value.code is ErrorCode.FRAME_TOO_LARGE
    # Still in flight after those refusals, so the daemon can send an error instead.
    assert pair.to_client(pair.server.error(request_id, ErrorCode.INTERNAL, "Too big.")) == [
        RequestFailed(request_id, ErrorCode.INTERNAL, "Too big.")
    ]


def test_client_respects_the_servers_frame_limit() -> None:
    pair = Pair(max_frame_size=4096).connect()
    with pytest.raises(LocalProtocolError) as caught:
        pair.client.request(ShowJob("x" * 5000))
    assert caught.value.code is ErrorCode.FRAME_TOO_LARGE
    assert pair.client.in_flight == frozenset()


def test_client_cannot_request_before_welcome() -> None:
    client = ClientConnection("alice", None)
    with pytest.raises(LocalProtocolError):
        client.request(Ping())
    client.start()
    with pytest.raises(LocalProtocolError):
        client.request(Ping())
    with pytest.raises(LocalProtocolError):
        client.start()  # only once


def test_request_ids_wrap_around_and_skip_in_flight() -> None:
    pair = Pair().connect()
    pair.client._next_id = MAX_REQUEST_ID - 1
    ids = [pair.request(Ping()) for _ in range(2)]
    assert ids == [MAX_REQUEST_ID - 1, MAX_REQUEST_ID]
    pair.client._next_id = MAX_REQUEST_ID
    assert pair.request(Ping()) == 1


# -- the client checks the server too -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (raw_frame(FrameType.REPLY, 42, {"op": "pong", "server_time": 1.0}), ErrorCode.UNEXPECTED_FRAME),
        (raw_frame(FrameType.ERROR, 42, {"code": 41, "message": "x"}), ErrorCode.UNEXPECTED_FRAME),
        (raw_frame(FrameType.REPLY, 1, {"op": "job_list", "jobs": []}), ErrorCode.BAD_PAYLOAD),
        (
            raw_frame(FrameType.STREAM, 1, {"op": "log_chunk", "data": b"", "offset": ""}),
            ErrorCode.BAD_PAYLOAD,
        ),
        (raw_frame(FrameType.REQUEST, 1, {"op": "ping"}), ErrorCode.UNEXPECTED_FRAME),
        (raw_frame(FrameType.WELCOME, 0, {}), ErrorCode.UNEXPECTED_FRAME),
    ],
)
def test_client_rejects_bad_answers(frame: bytes, code: ErrorCode) -> None:
    pair = Pair().connect()
    assert pair.request(Ping()) == 1
    events = pair.to_client(frame)
    assert len(events) == 1
    assert isinstance(events[0], ConnectionFailed)
    assert (events[0].code, events[0].by_peer) == (code, False)
    error_bytes = pair.client.data_to_send()
    assert fatal_error(error_bytes).code == code
    # The server learns why and closes too.
    assert pair.to_server(error_bytes) == [ConnectionFailed(code, events[0].message, by_peer=True)]
    assert pair.server.state is State.CLOSED


# -- keepalive, shutdown, end of input ------------------------------------------------------------------


def test_ping_pong_both_ways() -> None:
    pair = Pair().connect()
    assert pair.to_server(pair.client.ping(7)) == []
    assert pair.to_client(pair.server.data_to_send()) == [PongReceived(7)]
    assert pair.to_client(pair.server.ping(9)) == []
    assert pair.to_server(pair.client.data_to_send()) == [PongReceived(9)]


def test_server_goodbye_lets_in_flight_requests_finish() -> None:
    pair = Pair().connect()
    request_id = pair.request(Ping())
    crossing = raw_frame(FrameType.REQUEST, 50, {"op": "ping"})  # sent before the client saw GOODBYE
    assert pair.to_client(pair.server.goodbye("restarting")) == [GoodbyeReceived("restarting")]
    assert pair.server.state is pair.client.state is State.CLOSING
    with pytest.raises(LocalProtocolError) as caught:
        pair.client.request(Ping())
    assert caught.value.code is ErrorCode.SHUTTING_DOWN

    pair.client._in_flight[50] = Ping  # as if the client had sent it just before GOODBYE arrived
    assert pair.to_server(crossing) == []
    answer = pair.server.data_to_send()
    assert pair.to_client(answer) == [
        RequestFailed(50, ErrorCode.SHUTTING_DOWN, "The server is shutting down; retry on a new connection.")
    ]
    assert pair.to_client(pair.server.reply(request_id, Pong(1.0))) == [
        ReplyReceived(request_id, Pong(1.0), final=True)
    ]
    assert pair.server.in_flight == frozenset()  # now the daemon closes the socket
    assert pair.to_client(b"") == [ConnectionClosed()]


def test_client_goodbye() -> None:
    pair = Pair().connect()
    assert pair.to_server(pair.client.goodbye("done")) == [GoodbyeReceived("done")]
    assert pair.server.state is State.CLOSING
    assert pair.to_server(b"") == [ConnectionClosed()]


def test_abort_for_a_timeout() -> None:
    pair = Pair().connect()
    data = pair.server.abort(ErrorCode.IDLE_TIMEOUT, "Idle for 300 s; reconnect when you need the pool.")
    assert pair.server.state is State.CLOSED
    assert pair.server.abort(ErrorCode.IDLE_TIMEOUT, "again") == b""
    assert pair.to_client(data) == [
        ConnectionFailed(
            ErrorCode.IDLE_TIMEOUT, "Idle for 300 s; reconnect when you need the pool.", by_peer=True
        )
    ]


def test_handshake_timeout_abort_before_ready() -> None:
    pair = Pair()
    pair.to_server(pair.client.start())
    assert pair.server.state is State.AWAIT_AUTH  # the daemon's handshake timer is still running
    data = pair.server.abort(ErrorCode.HANDSHAKE_TIMEOUT, "No AUTH within 10 s.")
    assert fatal_error(data).code == ErrorCode.HANDSHAKE_TIMEOUT


def test_end_of_input() -> None:
    pair = Pair().connect()
    request_id, data = pair.client.request(Ping())
    pair.server.receive_data(data[:5])
    pair.server.receive_data(b"")
    assert drain(pair.server) == [ConnectionClosed()]
    assert pair.server.in_flight == frozenset()
    assert pair.server.next_event() == ConnectionClosed()  # and ever after
    assert pair.server.reply(request_id, Pong(1.0)) == b""  # late answers are dropped quietly


def test_closed_connection_ignores_input() -> None:
    pair = Pair().connect()
    events = pair.to_server(b"garbage")
    assert isinstance(events[0], ConnectionFailed)
    pair.server.data_to_send()
    assert pair.to_server(raw_frame(FrameType.REQUEST, 1, {"op": "ping"})) == [ConnectionClosed()]
    assert pair.server.data_to_send() == b""
    with pytest.raises(LocalProtocolError):
        pair.server.goodbye("late")


def test_frames_before_a_violation_are_processed_first() -> None:
    pair = Pair().connect()
    request_id, data = pair.client.request(Ping())
    events = pair.to_server(data + b"junk")
    assert events[0] == RequestReceived(request_id, Ping())
    assert isinstance(events[1], ConnectionFailed)


def test_an_account_request_is_answered_by_its_rows_and_a_wrong_type_is_refused() -> None:
    """issue 50, accounting: Account travels the wire and Accounted answers it (sans-IO: a
    connected pair, no event loop); a request whose `by` is not a string is refused by the
    server's end as a malformed payload (BAD_PAYLOAD), as any mistyped field is."""
    pair = Pair().connect()
    request = Account("alice", None, 1712345678.0, None, "day")
    request_id = pair.request(request)
    answer = Accounted([{"day": "2024-04-05", "jobs": 1}], {"jobs": 1}, 1712345678.0, 1712400000.0)
    data = pair.server.reply(request_id, answer)
    assert pair.to_client(data) == [ReplyReceived(request_id, answer, final=True)]
    payload = {"op": "account", "user": None, "queue": None, "since": None, "until": None, "by": 3}
    events = pair.to_server(raw_frame(FrameType.REQUEST, 9, payload))
    assert_server_failed(pair, events, ErrorCode.BAD_PAYLOAD)
