"""One request and its reply over a blocking socket: what most poolctl commands are (enqueue, ls,
show, cancel, workers, health, and the streamed wait, ls --watch and top). No event loop to
import and start: importing asyncio alone took longer than connecting, authenticating and asking.
The protocol is sans-IO (`protocol.ClientConnection`): this and the async `PoolClient` drive the
same state machine, and client/session.py holds what they share (addresses, TLS and its pin, what each
failure means).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import TypeVar

from daemon.address import unix_path
from daemon.client import session
from daemon.client.session import ClientError
from protocol import (
    NEED_DATA,
    ClientConnection,
    ConnectionClosed,
    ConnectionFailed,
    Event,
    LocalProtocolError,
    Reply,
    ReplyReceived,
    Request,
    RequestFailed,
    StreamItem,
)

R = TypeVar("R", bound=Reply)

HANDSHAKE_SECONDS = 10.0  # to connect, and to be let in; the request itself may take its time
READ_SIZE = 256 * 1024


def call(
    server: str,
    user: str,
    token: str | None,
    request: Request,
    reply_type: type[R],
    *,
    tls_ca: str | None = None,
    tls: str = "auto",
    tls_pin: str | None = None,
    on_item: Callable[[StreamItem], None] | None = None,
) -> R:
    """Connect to `server` as `user`, send `request`, and return its final reply, checked to be
    a `reply_type`; each item streamed before it goes to `on_item` (a live view, a job that
    ended), or is dropped. Raises ClientError (ServerUnreachable, AuthFailed) as PoolClient does.

    `server` may name several servers of one pool (session.addresses): one that cannot be reached
    is passed over for the next, and so is one that goes away before it answers, if the request
    may be sent again (session.repeatable: a `wait` then waits on the next server, whose stream
    starts again with the jobs that ended already)."""
    targets = session.addresses(server)
    for i, address in enumerate(targets):
        try:
            return _call(address, user, token, request, reply_type, tls_ca, tls, tls_pin, on_item)
        except ClientError as exc:
            if (
                i + 1 == len(targets)
                or not session.gone(exc)
                or (exc.sent and not session.repeatable(request))
            ):
                raise
            session.moving_on(targets[i + 1], exc)
    raise AssertionError("unreachable: the last server's failure is raised")


def _call(  # noqa: PLR0917
    address: str,
    user: str,
    token: str | None,
    request: Request,
    reply_type: type[R],
    tls_ca: str | None,
    tls: str,
    tls_pin: str | None,
    on_item: Callable[[StreamItem], None] | None,
) -> R:
    sock, conn, events = _open(address, user, token, tls_ca, tls, tls_pin)
    try:
        try:
            request_id, data = conn.request(request)
        except LocalProtocolError as exc:  # too large, or the server said goodbye before it left
            raise session.not_sent(exc, address) from None
        try:
            sock.sendall(data)
        except OSError as exc:  # some of it may have arrived: sent, as far as a retry is concerned
            raise _after_sending(session.unreachable(address, exc)) from None
        for event in events:
            match event:
                case ReplyReceived(request_id=rid, message=message, final=True) if rid == request_id:
                    if not isinstance(message, reply_type):
                        raise ClientError(
                            f"unexpected reply {type(message).__name__} to {type(request).__name__}"
                        )
                    return message
                case ReplyReceived(request_id=rid, message=message) if rid == request_id and on_item:
                    on_item(message)  # type: ignore[arg-type] # final=False: a StreamItem
                case RequestFailed(request_id=rid, code=code, message=text) if rid == request_id:
                    raise ClientError(text, code)
                case ConnectionFailed() | ConnectionClosed():
                    raise _after_sending(session.connection_ended(event, address))
        raise _after_sending(session.connection_ended(ConnectionClosed(), address))
    finally:
        sock.close()


def _connect(host: str, port: int) -> socket.socket:
    """A connected socket to (host, port), or to the Unix socket `host` names (unix:PATH)."""
    path = unix_path(host)
    if path is None:
        return socket.create_connection((host, port), timeout=HANDSHAKE_SECONDS)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(HANDSHAKE_SECONDS)
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


def _open(  # noqa: PLR0917
    address: str, user: str, token: str | None, tls_ca: str | None, tls: str, tls_pin: str | None
) -> tuple[socket.socket, ClientConnection, Iterator[Event]]:
    """A connection to `address`, TLS as `tls` says, `user` let in: the socket, its protocol state
    and its events. ServerUnreachable when the server is not there or goes away meanwhile."""
    host, port = session.parse_address(address)
    use_tls = session.wants_tls(host, tls, tls_ca, tls_pin)
    conn = session.connection(user, token)
    try:
        sock = _connect(host, port)
    except OSError as exc:
        raise session.unreachable(address, exc) from None
    try:
        if use_tls:
            try:
                sock = session.tls_context(tls_ca).wrap_socket(sock, server_hostname=session.tls_name(host))
            except OSError as exc:
                raise session.unreachable(address, exc) from None
            session.check_pin(address, tls_ca, sock, tls_pin)
        events = _events(sock, conn, address)
        try:
            sock.sendall(conn.start())
        except OSError as exc:  # reset, or the pipe broken: not there
            raise session.unreachable(address, exc) from None
        while session.handshake_outcome(next(events), address, user) is None:
            pass
        sock.settimeout(None)
    except session.ClosedAtHandshake:
        sock.close()
        if not use_tls and (why := session.plain_to_tls(address)) is not None:
            raise why from None
        raise
    except BaseException:
        sock.close()
        raise
    return sock, conn, events


def _events(sock: socket.socket, conn: ClientConnection, address: str) -> Iterator[Event]:
    """The connection's events, reading as they need, writing what the protocol answers."""
    while True:
        event = conn.next_event()
        if out := conn.data_to_send():
            sock.sendall(out)
        if event is not NEED_DATA:
            yield event
            if isinstance(event, (ConnectionFailed, ConnectionClosed)):
                return
            continue
        try:
            conn.receive_data(sock.recv(READ_SIZE))
        except TimeoutError:
            raise session.ServerUnreachable(f"the server at {address} did not finish the handshake") from None
        except OSError:
            conn.receive_data(b"")  # a reset: the connection closed


def _after_sending(exc: ClientError) -> ClientError:
    exc.sent = True
    return exc
