"""Issue 49: channels, the bidirectional streams `poolctl exec` (and later shell, attach and forward)
run on. An OpenChannel request stays in flight while the server streams ChannelOutput and the
client sends ChannelData in CHANNEL frames, each direction held to a window of CHANNEL_WINDOW
bytes. These tests drive a connected client/server pair by hand, including a hostile client whose
frames must never make the server hold more than one window per channel."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from protocol import (
    CHANNEL_WINDOW,
    ChannelAck,
    ChannelAcked,
    ChannelClosed,
    ChannelCredit,
    ChannelData,
    ChannelDataReceived,
    ChannelEnd,
    ChannelEndReceived,
    ChannelOutput,
    ChannelResize,
    ChannelResized,
    ErrorCode,
    FollowLogs,
    LocalProtocolError,
    OpenChannel,
    ReplyReceived,
    State,
)
from protocol.codec import encode_message
from protocol.frames import HEADER, FrameType
from tests.protocol.helpers import Pair, assert_server_failed, raw_frame

EXEC = OpenChannel("default.1", "exec", ["cat"], stdin=True)


def opened(stdin: bool = True) -> tuple[Pair, int]:
    pair = Pair().connect()
    return pair, pair.request(OpenChannel("default.1", "exec", ["cat"], stdin=stdin))


def channel_frame(rid: int, message: ChannelData | ChannelEnd | ChannelAck | ChannelResize) -> bytes:
    """A CHANNEL frame built without the client's checks: what a hostile client sends."""
    frame_type, payload = encode_message(message)
    assert frame_type is FrameType.CHANNEL
    return raw_frame(FrameType.CHANNEL, rid, payload)


def test_input_output_credit_and_end_go_both_ways_on_one_request_id() -> None:
    """Issue 49, the wire: stdin goes up as ChannelData, is credited back, output comes down as
    ChannelOutput and is acknowledged, EOF is ChannelEnd, and ChannelClosed ends the request."""
    pair, rid = opened()
    assert pair.to_server(pair.client.channel_data(rid, b"hi\n")) == [ChannelDataReceived(rid, b"hi\n")]
    assert pair.client.input_room(rid) == CHANNEL_WINDOW - 3
    assert pair.to_client(pair.server.credit(rid, 3)) == [ReplyReceived(rid, ChannelCredit(3), False)]
    assert pair.client.input_room(rid) == CHANNEL_WINDOW
    out = ChannelOutput("stdout", b"hi\n")
    assert pair.to_client(pair.server.stream(rid, out)) == [ReplyReceived(rid, out, False)]
    assert pair.server.output_room(rid) == CHANNEL_WINDOW - 3
    assert pair.to_server(pair.client.channel_ack(rid, 3)) == [ChannelAcked(rid, 3)]
    assert pair.server.output_room(rid) == CHANNEL_WINDOW
    assert pair.to_server(pair.client.channel_end(rid)) == [ChannelEndReceived(rid)]
    assert pair.client.input_room(rid) == 0
    closed = ChannelClosed(0, "exited")
    assert pair.to_client(pair.server.reply(rid, closed)) == [ReplyReceived(rid, closed, True)]
    assert pair.client.in_flight == pair.server.in_flight == frozenset()


def test_each_side_refuses_to_send_past_the_window() -> None:
    """Issue 49: neither reference side sends more than the peer has room for, nor input after
    its end or on a channel without stdin."""
    pair, rid = opened()
    pair.to_server(pair.client.channel_data(rid, b"x" * CHANNEL_WINDOW))
    with pytest.raises(LocalProtocolError) as refused:
        pair.client.channel_data(rid, b"y")
    assert refused.value.code is ErrorCode.FLOW_CONTROL
    pair.to_client(pair.server.stream(rid, ChannelOutput("stderr", b"z" * CHANNEL_WINDOW)))
    with pytest.raises(LocalProtocolError):
        pair.server.stream(rid, ChannelOutput("stdout", b"z"))
    with pytest.raises(LocalProtocolError):
        pair.server.credit(rid, CHANNEL_WINDOW + 1)
    pair, rid = opened(stdin=False)
    with pytest.raises(LocalProtocolError):
        pair.client.channel_data(rid, b"x")


def test_a_hostile_client_cannot_send_past_the_window() -> None:
    """Issue 49, hostile frames: a client that streams data without waiting for credit is cut off
    at the first byte past the window (fatal FLOW_CONTROL), however it splits its frames and
    whether it feeds them whole or a byte at a time: the server never holds more than one window
    of a channel's input (its partial frame aside, which the frame limit bounds)."""
    for byte_at_a_time in (False, True):
        pair, rid = opened()
        chunk = channel_frame(rid, ChannelData(b"x" * (CHANNEL_WINDOW // 4)))
        flood = chunk * 4 + channel_frame(rid, ChannelData(b"!"))
        events = []
        pieces = [flood[i : i + 1] for i in range(len(flood))] if byte_at_a_time else [flood]
        for piece in pieces:
            events += pair.to_server(piece)
            assert pair.server.buffered <= len(chunk)
        received = [e for e in events if isinstance(e, ChannelDataReceived)]
        assert sum(len(e.data) for e in received) == CHANNEL_WINDOW
        assert_server_failed(pair, events[len(received) :], ErrorCode.FLOW_CONTROL)


@pytest.mark.parametrize(
    ("message", "code"),
    [
        (ChannelAck(1), ErrorCode.FLOW_CONTROL),  # acknowledges output never sent
        (ChannelAck(0), ErrorCode.FLOW_CONTROL),
        (ChannelAck(-5), ErrorCode.FLOW_CONTROL),  # would widen the window
    ],
)
def test_a_hostile_client_cannot_acknowledge_what_it_never_got(message: ChannelAck, code: ErrorCode) -> None:
    """Issue 49, hostile frames: an acknowledgement can only give back room the server used."""
    pair, rid = opened()
    assert_server_failed(pair, pair.to_server(channel_frame(rid, message)), code)


def test_input_after_its_end_or_without_stdin_is_a_violation() -> None:
    """Issue 49, hostile frames: ChannelData after ChannelEnd, a second ChannelEnd, or data on a
    channel opened without stdin."""
    pair, rid = opened()
    pair.to_server(pair.client.channel_end(rid))
    events = pair.to_server(channel_frame(rid, ChannelData(b"late")))
    assert_server_failed(pair, events, ErrorCode.UNEXPECTED_FRAME)
    pair, rid = opened(stdin=False)
    events = pair.to_server(channel_frame(rid, ChannelData(b"x")))
    assert_server_failed(pair, events, ErrorCode.UNEXPECTED_FRAME)


def test_channel_input_on_a_request_that_is_no_channel_is_a_violation() -> None:
    """Issue 49, hostile frames: CHANNEL frames belong to open_channel requests only."""
    pair = Pair().connect()
    rid = pair.request(FollowLogs("default.1", follow=True, offset=""))
    events = pair.to_server(channel_frame(rid, ChannelData(b"x")))
    assert_server_failed(pair, events, ErrorCode.UNEXPECTED_FRAME)


def test_channel_input_for_a_finished_or_unknown_request_is_dropped_and_kept_nowhere() -> None:
    """Issue 49, hostile frames: input for a channel that has ended (its ChannelClosed crossed
    the input on the wire) or for an id never used is dropped, as a late CANCEL is: no event, no
    error, nothing held, however much of it comes."""
    pair, rid = opened()
    pair.server.reply(rid, ChannelClosed(0, "exited"))
    for target in (rid, 999):
        for _ in range(64):
            assert pair.to_server(channel_frame(target, ChannelData(b"x" * CHANNEL_WINDOW))) == []
        assert pair.server.buffered == 0
    assert pair.server.state is State.READY
    assert pair.server.data_to_send() == b""
    assert pair.server.output_room(rid) == 0


def test_a_hostile_server_cannot_send_output_past_the_window() -> None:
    """Issue 49: the client holds the server to the same window (a terminal that is not read
    must not fill the client's memory either)."""
    pair, rid = opened()
    flood = b"".join(
        raw_frame(
            FrameType.STREAM, rid, encode_message(ChannelOutput("stdout", b"o" * (CHANNEL_WINDOW // 2)))[1]
        )
        for _ in range(3)
    )
    events = pair.to_client(flood)
    assert len([e for e in events if isinstance(e, ReplyReceived)]) == 2
    assert events[-1].code == ErrorCode.FLOW_CONTROL  # type: ignore[union-attr]
    assert pair.client.state is State.CLOSED


def test_a_channel_frame_from_the_server_is_a_violation() -> None:
    """Issue 49: CHANNEL frames go from client to server only."""
    pair, rid = opened()
    events = pair.to_client(channel_frame(rid, ChannelData(b"x")))
    assert events[-1].code == ErrorCode.UNEXPECTED_FRAME  # type: ignore[union-attr]


def test_channel_frames_need_a_request_id() -> None:
    """Issue 49: like REQUEST and STREAM, a CHANNEL frame names its request."""
    pair, _ = opened()
    payload = encode_message(ChannelEnd())[1]
    frame = HEADER.pack(b"GP", 1, FrameType.CHANNEL, 0, 0, 0, len(payload)) + payload
    events = pair.to_server(frame)
    assert_server_failed(pair, events, ErrorCode.BAD_HEADER)


class ChannelModel(RuleBasedStateMachine):
    """Issue 49, a model of one channel (STYLE §18): random interleavings of the owners' legal
    moves on both sides, with bytes delivered whole or not yet, checked after every step against a
    plain count of what is in flight each way: neither side ever refuses a legal move, and neither
    has more than one window of the other's data unacknowledged."""

    def __init__(self) -> None:
        super().__init__()
        self.pair, self.rid = opened()
        self.to_server = bytearray()  # bytes the client wrote that the server has not read yet
        self.to_client = bytearray()
        self.input_unacked = 0  # ChannelData bytes not yet credited (as the client counts them)
        self.output_unacked = 0
        self.output_untaken = 0  # output the client received and has not acknowledged yet
        self.input_ended = False

    @rule(size=st.integers(1, CHANNEL_WINDOW))
    def client_sends(self, size: int) -> None:
        room = self.pair.client.input_room(self.rid)
        assert room == (0 if self.input_ended else CHANNEL_WINDOW - self.input_unacked)
        if room:
            self.to_server += self.pair.client.channel_data(self.rid, b"i" * min(size, room))
            self.input_unacked += min(size, room)

    @rule()
    def client_ends(self) -> None:
        if not self.input_ended:
            self.to_server += self.pair.client.channel_end(self.rid)
            self.input_ended = True

    @rule(size=st.integers(1, CHANNEL_WINDOW))
    def server_sends(self, size: int) -> None:
        room = self.pair.server.output_room(self.rid)
        assert room == CHANNEL_WINDOW - self.output_unacked
        if room:
            self.to_client += self.pair.server.stream(
                self.rid, ChannelOutput("stdout", b"o" * min(size, room))
            )
            self.output_unacked += min(size, room)

    @precondition(lambda self: self.to_server)  # b"" would be the end of input
    @rule()
    def server_reads(self) -> None:
        for event in self.pair.to_server(bytes(self.to_server)):
            match event:
                case ChannelDataReceived(data=data):  # the far end takes it at once
                    self.to_client += self.pair.server.credit(self.rid, len(data))
                case ChannelAcked(size=size):
                    self.output_unacked -= size
                case ChannelEndReceived():
                    pass
                case _:
                    raise AssertionError(event)
        self.to_server.clear()

    @precondition(lambda self: self.to_client)
    @rule()
    def client_reads(self) -> None:
        for event in self.pair.to_client(bytes(self.to_client)):
            assert isinstance(event, ReplyReceived), event
            match event.message:
                case ChannelOutput(data=data):
                    self.output_untaken += len(data)
                case ChannelCredit(size=size):
                    self.input_unacked -= size
        self.to_client.clear()

    @rule()
    def client_acks(self) -> None:
        if self.output_untaken:
            self.to_server += self.pair.client.channel_ack(self.rid, self.output_untaken)
            self.output_untaken = 0

    @invariant()
    def within_the_windows(self) -> None:
        assert 0 <= self.input_unacked <= CHANNEL_WINDOW
        assert 0 <= self.output_unacked <= CHANNEL_WINDOW
        assert self.pair.server.state is State.READY
        assert self.pair.client.state is State.READY


ChannelModel.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, derandomize=True, database=None, deadline=None
)
test_the_channel_model = ChannelModel.TestCase


def test_a_resize_goes_up_as_an_event_outside_the_window_even_after_the_input_ends() -> None:
    """Issue 49, `shell`'s window sizes: ChannelResize is channel input the server hears as
    ChannelResized (an attach's terminal then takes that size), counted by no window (the input's
    room is as it was), and it may come after ChannelEnd: a terminal's size is not its data."""
    pair = Pair().connect()
    rid = pair.request(OpenChannel("default.1", "attach", [], stdin=True, rows=24, cols=80))
    assert pair.to_server(pair.client.channel_resize(rid, 50, 132)) == [ChannelResized(rid, 50, 132)]
    assert pair.client.input_room(rid) == CHANNEL_WINDOW
    pair.to_server(pair.client.channel_end(rid))
    assert pair.to_server(pair.client.channel_resize(rid, 1, 65535)) == [ChannelResized(rid, 1, 65535)]


@pytest.mark.parametrize(("rows", "cols"), [(0, 80), (24, 0), (65536, 80), (24, -1)])
def test_a_resize_out_of_a_terminals_range_is_refused_by_each_side(rows: int, cols: int) -> None:
    """Issue 49: a terminal's size is two 16-bit counts from 1 (struct winsize): the reference
    client refuses to send another, and a server that gets one from a hostile client closes the
    connection saying why, never handing a worker a size no terminal has."""
    pair, rid = opened()
    with pytest.raises(LocalProtocolError) as refused:
        pair.client.channel_resize(rid, rows, cols)
    assert refused.value.code is ErrorCode.BAD_PAYLOAD
    events = pair.to_server(channel_frame(rid, ChannelResize(rows, cols)))
    assert_server_failed(pair, events, ErrorCode.BAD_PAYLOAD)
