"""Error codes of the wire protocol and the exceptions that carry them.

Every error that can cross the wire is a :class:`ProtocolError`: a numeric :class:`ErrorCode` for the
ERROR frame and one human sentence saying what was wrong and what to do about it. The sentence is
meant to be printed as-is by ``poolctl``, so it must never contain a secret (tokens, MACs).

Codes are grouped by tens so a client in another language can act on a range it does not know yet:

* ``1x`` framing: the bytes could not be read as frames. Always fatal.
* ``2x`` session: readable frames that broke the conversation's rules. Always fatal.
* ``4x`` request: the request was understood but cannot be done. Sent with the request's id; the
  connection stays open.
* ``5x`` server: the server cannot do it right now. Request-level or fatal, depending on whether the
  ERROR frame carries a request id or request id 0.

What makes an ERROR frame fatal is its request id (0 = the connection is closing), not its code; the
ranges only say where each code normally appears.
"""

from enum import IntEnum

__all__ = ["ErrorCode", "LocalProtocolError", "ProtocolError", "RemoteProtocolError"]


class ErrorCode(IntEnum):
    """The code carried by an ERROR frame (docs/PROTOCOL.md has the full table)."""

    # 1x framing
    BAD_MAGIC = 10
    UNSUPPORTED_VERSION = 11
    BAD_HEADER = 12
    FRAME_TOO_LARGE = 13
    UNKNOWN_FRAME_TYPE = 14
    BAD_PAYLOAD = 15

    # 2x session
    UNEXPECTED_FRAME = 20
    NOT_AUTHENTICATED = 21
    AUTH_FAILED = 22
    HANDSHAKE_TIMEOUT = 23
    IDLE_TIMEOUT = 24
    TOO_MANY_REQUESTS = 25
    DUPLICATE_REQUEST_ID = 26
    UNKNOWN_OP = 27
    FLOW_CONTROL = 28

    # 4x request
    INVALID_ARGUMENT = 40
    NOT_FOUND = 41
    CONFLICT = 42
    CANCELLED = 43
    PERMISSION_DENIED = 44
    RESOURCE_EXHAUSTED = 45

    # 5x server
    UNAVAILABLE = 50
    SHUTTING_DOWN = 51
    INTERNAL = 52

    @classmethod
    def coerce(cls, value: int) -> int:
        """Return the member for ``value`` if it is a known code, else ``value`` unchanged.

        A newer peer may send a code this version does not know; keeping the number (rather than
        failing or mapping it to INTERNAL) lets the caller still report it faithfully.
        """
        try:
            return cls(value)
        except ValueError:
            return value


class ProtocolError(Exception):
    """Something broke the protocol; ``code`` goes in the ERROR frame, ``message`` to the human."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.name}, {self.message!r})"


class LocalProtocolError(ProtocolError):
    """We were about to send something illegal: a bug in the caller, nothing went on the wire."""


class FrameTooLarge(LocalProtocolError):
    """A message larger than the peer takes in one frame: its `size` and the peer's `limit`, in
    bytes, so that the caller can say what was too big and by how much."""

    def __init__(self, kind: str, size: int, limit: int) -> None:
        super().__init__(
            ErrorCode.FRAME_TOO_LARGE,
            f"A {kind} payload of {size} bytes exceeds the peer's limit of {limit} bytes; send less "
            "per frame (page or stream the data).",
        )
        self.size = size
        self.limit = limit


class RemoteProtocolError(ProtocolError):
    """The peer sent something illegal; the connection answers with an ERROR frame and closes."""
