"""A channel's flow control: one record per open channel, kept by each side's connection.

A channel (docs/PROTOCOL.md §5, "Channels") is an OpenChannel request that stays in flight while
bytes go both ways: the server streams ChannelOutput items, the client sends ChannelData in
CHANNEL frames. Each direction has a window of CHANNEL_WINDOW bytes: the sender may have at most
that many bytes out that the receiver has not acknowledged (ChannelAck for output, ChannelCredit
for input), so neither side can make the other buffer more than one window per channel, whatever
the far end (a command that never reads its stdin, a terminal that is never read) does.

The same record serves both sides; what a method refuses is the caller's to raise: a
RemoteProtocolError when the peer sent it, a LocalProtocolError when the owner tried to send it.
"""

from protocol.errors import ErrorCode
from protocol.messages import CHANNEL_WINDOW
from protocol.replies import ChannelCredit, ChannelOutput

__all__ = ["Channel", "Refusal"]

Refusal = tuple[ErrorCode, str]


class Channel:
    """The flow control of one open channel: the bytes of each direction not yet acknowledged,
    and whether its input may still come."""

    __slots__ = ("input_open", "input_unacked", "output_unacked")

    def __init__(self, stdin: bool) -> None:
        self.input_open = stdin  # ChannelData may come (until ChannelEnd; never without stdin)
        self.input_unacked = 0  # ChannelData bytes sent and not yet credited
        self.output_unacked = 0  # ChannelOutput bytes sent and not yet acknowledged

    @property
    def input_room(self) -> int:
        """How many bytes of ChannelData may be sent now."""
        return CHANNEL_WINDOW - self.input_unacked if self.input_open else 0

    @property
    def output_room(self) -> int:
        """How many bytes of ChannelOutput may be sent now."""
        return CHANNEL_WINDOW - self.output_unacked

    def add_input(self, size: int) -> Refusal | None:
        if not self.input_open:
            return (
                ErrorCode.UNEXPECTED_FRAME,
                "ChannelData on a channel whose input has ended (or has none)",
            )
        if size > self.input_room:
            return (
                ErrorCode.FLOW_CONTROL,
                f"ChannelData of {size} bytes with only {self.input_room} bytes of the "
                f"{CHANNEL_WINDOW}-byte window left; wait for ChannelCredit",
            )
        self.input_unacked += size
        return None

    def end_input(self) -> Refusal | None:
        if not self.input_open:
            return (ErrorCode.UNEXPECTED_FRAME, "ChannelEnd on a channel whose input has ended (or had none)")
        self.input_open = False
        return None

    @staticmethod
    def resize(rows: int, cols: int) -> Refusal | None:
        """A ChannelResize: a terminal's size, as its window-size record holds it (16 bits each)."""
        if not (0 < rows < 65536 and 0 < cols < 65536):
            return (ErrorCode.BAD_PAYLOAD, f"ChannelResize to {rows}x{cols}; rows and cols are 1 to 65535")
        return None

    def credit_input(self, size: int) -> Refusal | None:
        if not 0 < size <= self.input_unacked:
            return (
                ErrorCode.FLOW_CONTROL,
                f"ChannelCredit of {size} bytes when {self.input_unacked} are unacknowledged",
            )
        self.input_unacked -= size
        return None

    def add_output(self, size: int) -> Refusal | None:
        if size > self.output_room:
            return (
                ErrorCode.FLOW_CONTROL,
                f"ChannelOutput of {size} bytes with only {self.output_room} bytes of the "
                f"{CHANNEL_WINDOW}-byte window left; wait for ChannelAck",
            )
        self.output_unacked += size
        return None

    def ack_output(self, size: int) -> Refusal | None:
        if not 0 < size <= self.output_unacked:
            return (
                ErrorCode.FLOW_CONTROL,
                f"ChannelAck of {size} bytes when {self.output_unacked} are unacknowledged",
            )
        self.output_unacked -= size
        return None

    def count_stream_item(self, item: object) -> Refusal | None:
        """A stream item of the channel's request, counted as both ends count it (the server as it
        sends it, the client as it receives it): output against the window, credit for input."""
        match item:
            case ChannelOutput(data=data):
                return self.add_output(len(data))
            case ChannelCredit(size=size):
                return self.credit_input(size)
            case _:
                return None
