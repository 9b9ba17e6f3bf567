"""What a connection to the pool server is, whatever drives it: the async `PoolClient`
(pool_client.py) and the blocking `one_shot` call share it. Loop-free, and light to import: most
poolctl commands are one request, and a command's start is mostly its imports.

It says where to connect (`parse_address`; `addresses`: a pool may have several servers, tried
in order, and a request `repeatable` on another goes on there when its server goes away), whether
with TLS and how to trust the server (`tls_context`, `check_pin`: known_servers.py), and what each
way of failing means to a user: `ClientError` and its kinds, each with the sentence poolctl prints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from daemon.address import is_loopback, parse_host_port, unix_path
from daemon.errors import GpupoolError
from protocol import (
    Account,
    Authenticated,
    CancelJobs,
    ClientConnection,
    ConnectionClosed,
    ConnectionFailed,
    Enqueue,
    ErrorCode,
    Event,
    FollowLogs,
    FrameTooLarge,
    ListJobs,
    ListWorkers,
    LocalProtocolError,
    Ping,
    PrepareDownload,
    Request,
    RequeueJobs,
    ResolveName,
    ShowJob,
    WaitJobs,
    WatchPool,
)

if TYPE_CHECKING:
    import ssl


class ClientError(GpupoolError):
    """A request or the connection failed; `code` is the error code the server sent (kept as a
    number when this version does not know it), INTERNAL when it sent none. `sent`: the request
    had left when the connection failed (it may have been acted on)."""

    sent = False


class ServerUnreachable(ClientError):
    pass


class AuthFailed(ClientError):
    pass


class ClosedAtHandshake(ServerUnreachable):
    """The server closed the connection before it let poolctl in (before a word of refusal)."""


TLS_PROBE_SECONDS = 2.0  # to connect again and finish a TLS handshake, when asking whether it speaks TLS


class RequestTooLarge(ClientError):
    """A request larger than the server takes in one message (its max_frame_size); nothing of it
    was sent. `size` and `limit` are in bytes: a caller that knows what made it large says so."""

    code = ErrorCode.INVALID_ARGUMENT

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            f"the request is {mib(size)}, more than the {mib(limit)} the server takes in one "
            "message (max_frame_size in its config): send less at once"
        )
        self.size = size
        self.limit = limit


def mib(nbytes: int) -> str:
    """A size as a person reads it: "20.0 MiB"."""
    return f"{nbytes / 2**20:.1f} MiB"


def not_sent(exc: LocalProtocolError, address: str) -> ClientError:
    """Why a request could not leave: too large for the server, or the server said goodbye first
    (it is restarting or stopping). Any other reason is a bug of the caller's, raised as it is."""
    if isinstance(exc, FrameTooLarge):
        return RequestTooLarge(exc.size, exc.limit)
    if exc.code is ErrorCode.SHUTTING_DOWN:
        return ServerUnreachable(f"the server at {address} is closing this connection; connect again")
    raise exc


def parse_address(address: str) -> tuple[str, int]:
    """(host, port); for a Unix socket's address (unix:PATH), the address whole and port 0."""
    if (path := unix_path(address)) is not None:
        if not path:
            raise ClientError(f"{address!r} is not a server address; expected unix:PATH, a socket's path")
        return address, 0
    try:
        return parse_host_port(address, default_host="127.0.0.1")
    except ValueError as exc:
        raise ClientError(f"{address!r} is not a server address; {exc}") from None


def is_local(host: str) -> bool:
    """A host (parse_address's) on this machine: loopback, or a Unix socket."""
    return is_loopback(host) or unix_path(host) is not None


def tls_name(host: str) -> str:
    """The name a server's certificate is checked against: a Unix socket's server is this
    machine's, "localhost" (its own certificate names it)."""
    return "localhost" if unix_path(host) is not None else host


def addresses(server: str) -> list[str]:
    """The servers `server` names: one HOST:PORT, or several of one pool, comma-separated
    (GPUPOOL_SERVER=a:7420,b:7420), tried in that order. Raises ClientError naming a bad one."""
    found = [a.strip() for a in server.split(",") if a.strip()]
    if not found:
        raise ClientError(f"{server!r} names no server; expected HOST:PORT[,HOST:PORT...]")
    for address in found:
        parse_address(address)
    return found


# Requests whose second copy, on another server of the pool, does what the first would have: reads,
# cancels, waits and streams (a stream resumes where it was: FollowLogs from its offset).
REPEATABLE = (
    Account,
    ListJobs,
    ShowJob,
    CancelJobs,
    RequeueJobs,
    WaitJobs,
    WatchPool,
    FollowLogs,
    ListWorkers,
    Ping,
    ResolveName,
    PrepareDownload,
)


def repeatable(request: Request) -> bool:
    """Whether `request`, sent to a server that went away before it answered, may be sent again
    to another: an enqueue only with its idempotency key (else it could run twice)."""
    if isinstance(request, Enqueue):
        return request.idempotency_key is not None
    return isinstance(request, REPEATABLE)


def gone(exc: ClientError) -> bool:
    """Whether `exc` says the server went away (unreachable, the connection lost, or closing it
    as it stops), rather than answered: then another server of the pool may be asked."""
    return isinstance(exc, ServerUnreachable) or exc.code == ErrorCode.SHUTTING_DOWN


def moving_on(to: str, exc: ClientError) -> None:
    """Say on stderr why poolctl leaves a server, and that it goes on with the next."""
    import sys

    print(f"poolctl: {exc}\npoolctl: going on with the server at {to}", file=sys.stderr, flush=True)


def connection(user: str, token: str | None) -> ClientConnection:
    """The protocol's state machine for poolctl's connection as `user` (open mode: no token)."""
    return ClientConnection(user, token.encode() if token else None, client_name="poolctl")


def wants_tls(host: str, tls: str, tls_ca: str | None, tls_pin: str | None = None) -> bool:
    """`tls`: "auto" speaks TLS to a server beyond loopback, or to any with `tls_ca` or a pinned
    certificate; "on" always; "off" never."""
    if tls not in ("auto", "on", "off"):
        raise ClientError(f"tls = {tls!r} (GPUPOOL_TLS or pools.toml): expected auto, on or off")
    return tls != "off" and (tls == "on" or bool(tls_ca or tls_pin) or not is_local(host))


def tls_context(tls_ca: str | None) -> ssl.SSLContext:
    """Verified by `tls_ca`; else no CA vouches for the server's own certificate, and it is
    checked against its pin (`check_pin`) before a byte of the handshake is sent."""
    import ssl  # only with TLS: loopback pools never pay for it

    if tls_ca:
        return ssl.create_default_context(cafile=tls_ca)
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def check_pin(
    address: str, tls_ca: str | None, ssl_object: ssl.SSLObject | ssl.SSLSocket, tls_pin: str | None = None
) -> None:
    """Without a CA, the server's certificate must be `tls_pin` (the pool's, in pools.toml), else
    the one pinned for `address` in known_servers (or is pinned now, on first use)."""
    if tls_ca:
        return
    from daemon.client import known_servers

    der = ssl_object.getpeercert(binary_form=True)
    assert der is not None
    if tls_pin:
        known_servers.check_configured(address, der, tls_pin)
    else:
        known_servers.check(address, der)


def unreachable(address: str, exc: BaseException) -> ServerUnreachable:
    reason = getattr(exc, "strerror", None) or type(exc).__name__
    return ServerUnreachable(
        f"cannot reach the pool server at {address} ({reason}). Start one with `make run` "
        "(or `poold`), or point poolctl at yours with --server HOST:PORT or GPUPOOL_SERVER."
    )


def handshake_outcome(event: Event, address: str, user: str) -> Authenticated | None:
    """What a handshake event means: the welcome, or None to go on; a refusal raises."""
    match event:
        case Authenticated():
            return event
        case ConnectionFailed(code=code, message=message):
            if code == ErrorCode.AUTH_FAILED:
                raise AuthFailed(
                    f"the server at {address} refused user {user!r}: {message} "
                    "Check GPUPOOL_TOKEN or ~/.config/gpupool/token.",
                    code,
                )
            raise ClientError(f"the server refused the connection: {message}", code)
        case ConnectionClosed():
            raise ClosedAtHandshake(f"the server at {address} closed the connection")
    return None


def plain_to_tls(address: str) -> ServerUnreachable | None:
    """Why a server that closed a plain connection at its handshake did so, when the reason is that
    it speaks TLS only (poolctl speaks plain to a server on this machine unless told otherwise):
    what to set to reach it. None when it does not finish a TLS handshake either. Blocking, for
    at most TLS_PROBE_SECONDS; nothing is sent over the TLS connection, so its certificate goes
    unchecked."""
    import socket

    host, port = parse_address(address)
    path = unix_path(host)
    try:
        if path is None:
            sock = socket.create_connection((host, port), timeout=TLS_PROBE_SECONDS)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(TLS_PROBE_SECONDS)
            sock.connect(path)
        with tls_context(None).wrap_socket(sock, server_hostname=tls_name(host)):
            pass  # the handshake finished: the server speaks TLS
    except OSError:  # refused, reset, timed out, or no TLS (ssl.SSLError): not that
        return None
    from daemon.pools import pools_file

    return ServerUnreachable(
        f"the server at {address} speaks TLS only, and poolctl spoke plain to it: reach it with "
        f'TLS, with tls = "on" and its tls_pin (the fingerprint its poold logged at start) in its '
        f"entry in {pools_file()}, or GPUPOOL_TLS=on"
    )


def connection_ended(event: ConnectionFailed | ConnectionClosed, address: str) -> ClientError:
    """Why every request still waiting on a connection that ended failed."""
    if isinstance(event, ConnectionFailed):
        return ClientError(f"the server closed the connection: {event.message}", event.code)
    return ServerUnreachable(f"the connection to {address} was closed")
