"""The server's client listener: accepts connections, runs a Session for each, stops in two phases.

Every port is hostile (docs/DESIGN.md §9): the listener binds loopback unless told otherwise, refuses to
listen beyond loopback without tokens, caps the number of connections, and can speak TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import ssl
from collections import Counter
from collections.abc import Collection, Mapping
from pathlib import Path

from daemon.address import UNIX, is_loopback
from daemon.aio import cancel_and_wait
from daemon.errors import GpupoolError
from daemon.metrics.server import ServerMetrics
from daemon.server.handlers import Handlers
from daemon.server.session import DECODE_INLINE, FrameBudget, Limits, Session, peer_host
from daemon.server.throttle import Throttle
from protocol import ErrorCode, ServerConnection
from protocol.connection import error_frame

log = logging.getLogger(__name__)
STOP_ROUNDS = 3  # rounds of cancelling sessions at the stop: connections accepted as it closed


class ListenerError(GpupoolError):
    """The server cannot listen as configured (TLS files, an open port beyond loopback, a port in use)."""


def refuse_open_beyond_loopback(tokens: Mapping[str, bytes] | None, host: str, port: int) -> None:
    """A server without tokens answers anyone who can reach it: it may listen on loopback only."""
    if tokens is None and not is_loopback(host):
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise ListenerError(
            f"refusing to listen on {where} without authentication: set tokens_file "
            '(lines of user = "token"), or listen on 127.0.0.1'
        )


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ListenerError(f"cannot load the TLS certificate {cert} / key {key}: {exc}") from None
    return ctx


class Listener:
    def __init__(
        self,
        handlers: Handlers,
        tokens: Mapping[str, bytes] | None,
        host: str,
        port: int,
        *,
        tls: ssl.SSLContext | None = None,
        limits: Limits | None = None,
        metrics: ServerMetrics | None = None,
        socket: Path | None = None,
        throttle: Throttle | None = None,
    ) -> None:
        """`socket`: a Unix socket to listen on as well, for clients on this machine (no TCP
        stack on the way; the same handshake, tokens and TLS)."""
        refuse_open_beyond_loopback(tokens, host, port)
        self.handlers = handlers
        self.tokens = tokens
        self.host, self.port = host, port
        self.tls = tls
        self.limits = limits or Limits()
        self.metrics = metrics
        self._server: asyncio.Server | None = None
        self.socket = socket
        self._local: asyncio.Server | None = None  # on `socket`
        self._budget = FrameBudget(self.limits.max_partial_frames)
        self._users: Counter[str] = Counter()  # user -> authenticated connections
        # failed authentications, per peer and per user; the dashboard's sign-in shares it
        self.throttle = throttle or Throttle()
        self._sessions: dict[Session, asyncio.Task[None] | None] = {}
        self._stopping = False  # stop() has begun: it ends the sessions left

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def local_address(self) -> str:
        """Where a client on this machine connects best: the Unix socket when there is one."""
        return f"{UNIX}{self.socket}" if self.socket is not None else self.address

    async def start(self) -> None:
        try:
            # A TLS handshake happens before a session exists: it gets the same deadline as ours.
            self._server = await asyncio.start_server(
                self._accept,
                self.host,
                self.port,
                ssl=self.tls,
                ssl_handshake_timeout=self.limits.handshake_timeout if self.tls else None,
            )
        except OSError as exc:
            hint = " (is a pool already running here?)" if exc.errno == errno.EADDRINUSE else ""
            raise ListenerError(
                f"cannot listen on {self.address}: {os.strerror(exc.errno or 0).lower()}{hint}; "
                "choose another address with --listen HOST:PORT"
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]
        if self.socket is not None:
            await self._listen_locally(self.socket)
        log.info(
            "listening for clients on %s%s%s",
            self.address,
            " (TLS)" if self.tls else "",
            "" if self.tokens is not None else " (open: no tokens, loopback only)",
        )

    async def _listen_locally(self, path: Path) -> None:
        """Listen on the Unix socket `path` too (one a server that died left is replaced: whoever
        owns the data directory it is in runs one pool there at most), open to every local user
        as the loopback port is: a client gets in by the handshake, with a token."""
        try:
            self._local = await asyncio.start_unix_server(
                self._accept,
                path,
                ssl=self.tls,
                ssl_handshake_timeout=self.limits.handshake_timeout if self.tls else None,
            )
            os.chmod(path, 0o666)  # noqa: S103 - open as the loopback port is; the handshake guards it
        except OSError as exc:
            assert self._server is not None
            self._server.close()
            self._server = None
            raise ListenerError(
                f"cannot listen on {path}: {os.strerror(exc.errno or 0).lower()}; remove what is "
                "there, or give the server another data directory"
            ) from None

    def _make_room(self, host: str) -> int:
        """Close the oldest connections still authenticating while they are over their bound (of
        all, or of those from `host`, which a new one comes from) or hold the last places; returns
        how many connections are open after it."""
        open_ = [s for s in self._sessions if not s.evicted]
        waiting = sorted((s for s in open_ if s.authenticating), key=lambda s: s.opened_at)
        from_host = [s for s in waiting if s.host == host]
        while len(from_host) >= self.limits.max_unauthenticated_per_host:
            oldest = from_host.pop(0)
            oldest.evict(f"too many connections from {host} are authenticating; the oldest make room")
            waiting.remove(oldest)
            open_.remove(oldest)
        while waiting and (
            len(waiting) >= self.limits.max_unauthenticated or len(open_) >= self.limits.max_connections
        ):
            oldest = waiting.pop(0)
            oldest.evict("too many connections are authenticating; the oldest make room")
            open_.remove(oldest)
        return len(open_)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host = peer_host(writer)
        if backoff := self.throttle.refused(host, asyncio.get_running_loop().time()):
            # before the handshake, whatever token it would bring: it learns nothing of one
            why = f"too many failed authentications from {host}; retry in {math.ceil(backoff)} s"
            log.info("refusing a connection: %s", why)
            writer.write(error_frame(0, ErrorCode.TOO_MANY_REQUESTS, f"{why[0].upper()}{why[1:]}."))
            writer.close()
            return
        if self._make_room(host) >= self.limits.max_connections:
            writer.write(
                error_frame(0, ErrorCode.UNAVAILABLE, "The server has too many connections; retry later.")
            )
            writer.close()
            return
        conn = ServerConnection(
            self.tokens,
            max_frame_size=self.limits.max_frame_size,
            max_in_flight=self.limits.max_in_flight,
            decode_inline=DECODE_INLINE,  # larger requests are decoded off the loop (session.py)
        )
        on_error = self.metrics.protocol_error if self.metrics is not None else None
        session = Session(
            reader,
            writer,
            self.handlers,
            conn,
            self.limits,
            on_protocol_error=on_error,
            budget=self._budget,
            users=self._users,
            throttle=self.throttle,
        )
        self._sessions[session] = asyncio.current_task()
        if self.metrics is not None:
            self.metrics.connection_opened()
        try:
            await session.run()
        except asyncio.CancelledError:
            # Ended by stop(), which closed it: the connection's end, no error. Returned, not
            # raised: asyncio's stream server (3.11) would log the cancellation as a traceback.
            if not self._stopping:
                raise
        finally:
            del self._sessions[session]
            if self.metrics is not None:
                self.metrics.connection_closed()

    def cut_off(self, users: Collection[str]) -> int:
        """Close every connection of `users`, whose tokens were taken back (a reload of the tokens
        file): a connection made with a token must not outlive it. How many were closed."""
        closing = [s for s in self._sessions if s.user is not None and s.user in users]
        for session in closing:
            log.info("closing %s of %s: their token was taken back", session.peer, session.user)
            session.close_saying(
                ErrorCode.AUTH_FAILED,
                "Connection closed: the pool's admin took back the token it was made with; "
                "connect again with the token you have now.",
            )
        return len(closing)

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, say GOODBYE, let in-flight requests finish for `grace` seconds, then
        close every connection. Safe to call twice."""
        if self._server is None:
            return
        self._stopping = True
        self._server.close()
        if self._local is not None:
            self._local.close()
            self._local = None
            if self.socket is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.socket)
        for session in self._sessions:
            session.goodbye("the server is shutting down")
        running = [task for session in self._sessions for task in session.requests]
        if running:
            await asyncio.wait(running, timeout=grace)
        # cancel_and_wait, not `suppress(CancelledError)`: that would swallow a cancellation of stop().
        # Again while any is left: a connection the loop had accepted as the listener closed starts
        # its session after, and would outlive the server (its transport open at the loop's end).
        for _ in range(STOP_ROUNDS):
            tasks = [t for t in self._sessions.values() if t is not None]
            if not tasks:
                break
            await asyncio.gather(*(cancel_and_wait(task) for task in tasks))
            await asyncio.sleep(0)  # a callback the loop holds for such a connection runs now
        self._server = None
