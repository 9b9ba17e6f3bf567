"""The dashboard's routes and its listener (`web_listen`), on aiohttp's web server.

`WebServer` listens as the protocol's listener does: on loopback as it is; beyond loopback only
with tokens (a pool without them answers anyone who reaches it) and with TLS as `tls` says, on the
server's certificate. It stops with the server, ending every event stream (bounded).
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import ssl
from collections import Counter
from collections.abc import Mapping

from aiohttp import web

from daemon.errors import GpupoolError
from daemon.server.handlers import Handlers
from daemon.server.listener import ListenerError
from daemon.server.throttle import REMEMBERED, Throttle
from daemon.server.web import live, pages
from daemon.server.web.guard import SESSION_KEY, guard, host_names, session_of
from daemon.server.web.pages import HANDLERS, SNAPSHOTS, Handler, PageError, PageFunction
from daemon.server.web.render import STATIC, render_page
from daemon.server.web.signin import COOKIE, Sessions, user_of_token
from daemon.server.web.snapshot import Snapshots

log = logging.getLogger(__name__)

# The server's own map, not a copy: a reload (SIGHUP) changes it in place.
TOKENS: web.AppKey[Mapping[str, bytes] | None] = web.AppKey("tokens")
THROTTLE = web.AppKey("throttle", Throttle)
SIGN_INS = " dashboard sign-ins"  # the name sign-ins' failures count under (no user's begins with a space)
SECURE = web.AppKey("secure", bool)
SHUTDOWN_GRACE = 3.0  # seconds open event streams get to end when the server stops
MAX_HEAD = 8190  # bytes of a request line or header field
MAX_HEADERS = 64
IDLE_SECONDS = 15.0  # an idle connection, or one that sends no request, is closed after this


def action(function: Handler) -> Handler:
    """`function` with its refusals (PageError) shown as the error page, with their status."""

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            return await function(request)
        except PageError as exc:
            return render_page(request, "error.html", {"message": exc.message}, status=exc.status)

    return handler


def page(function: PageFunction) -> Handler:
    """A page: its template rendered with its context, or the error page."""

    async def rendered(request: web.Request) -> web.StreamResponse:
        template, context = await function(request)
        return render_page(request, template, context)

    return action(rendered)


async def signin_page(request: web.Request) -> web.StreamResponse:
    if session_of(request) is not None:
        raise web.HTTPSeeOther(_next(request))
    return render_page(request, "signin.html", {"open": request.app[TOKENS] is None, "failed": False})


async def signin(request: web.Request) -> web.StreamResponse:
    form = await request.post()
    tokens = request.app[TOKENS]
    if tokens is None:  # an open pool (loopback only): whoever is on the machine says who they are
        user = str(form.get("user", "")).strip() or None
    else:
        paced = await _paced(request, tokens, str(form.get("token", "")))
        if isinstance(paced, web.Response):
            return paced
        user = paced
    if user is None:
        log.info("dashboard: a sign-in from %s with an unknown token", request.remote)
        context = {"open": tokens is None, "failed": True}
        return render_page(request, "signin.html", context, status=401)
    sessions = request.app[SESSION_KEY]
    session = sessions.open(user)
    response = see_other(_next(request))
    response.set_cookie(
        COOKIE,
        session.id,
        max_age=int(sessions.lifetime),
        httponly=True,
        samesite="Strict",
        secure=request.app[SECURE],
        path="/",
    )
    return response


async def _paced(request: web.Request, tokens: Mapping[str, bytes], token: str) -> str | web.Response | None:
    """The user whose token `token` is (None: nobody's), as the throttle (throttle.py) paces it,
    or the refusal to answer with: a peer in back-off is refused (429) before the token is looked
    at; while sign-ins with a wrong token are in back-off, each waits its turn. A sign-in names no
    user, only a token that may be anyone's, so they all count under one name of their own, which
    a peer that signed in well lately is not paced by."""
    throttle = request.app[THROTTLE]
    peer = request.remote or "an unknown address"
    now = asyncio.get_running_loop().time()
    backoff = throttle.refused(peer, now)
    wait = None if backoff else throttle.wait(peer, SIGN_INS, now)
    if wait is None:
        refused = (
            f"Too many failed sign-ins from {peer}: try again in {math.ceil(backoff)} s."
            if backoff
            else f"Too many failed sign-ins lately: try again in {throttle.most_wait:g} s."
        )
        return render_page(request, "signin.html", {"open": False, "refused": refused}, status=429)
    user = user_of_token(tokens, token)
    if user is None:
        throttle.failed(peer, SIGN_INS, now)
    else:
        throttle.succeeded(peer, user)
        # its next sign-ins are not paced by others' failures; every user's share the name
        throttle.know(peer, SIGN_INS, keep=REMEMBERED)
    await asyncio.sleep(wait)
    return user


async def signout(request: web.Request) -> web.StreamResponse:
    request.app[SESSION_KEY].close(request.cookies.get(COOKIE, ""))
    response = see_other("/signin")
    response.del_cookie(COOKIE, path="/")
    return response


def see_other(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location})


def _next(request: web.Request) -> str:
    """Where to go after signing in: a path on this server only, never another site."""
    target = request.query.get("next", "/")
    on_this_server = target.startswith("/") and not target.startswith("//") and "\\" not in target
    # isprintable: a browser drops tabs and newlines from a URL, so "/\t/evil.example" is "//evil.example"
    return target if on_this_server and target.isprintable() else "/"


def make_app(
    handlers: Handlers,
    snapshots: Snapshots,
    tokens: Mapping[str, bytes] | None,
    hosts: frozenset[str],
    *,
    secure: bool,
    throttle: Throttle,
) -> web.Application:
    app = web.Application(middlewares=[guard(hosts)], client_max_size=64 * 1024)
    app[HANDLERS] = handlers
    app[SNAPSHOTS] = snapshots
    app[SESSION_KEY] = Sessions()
    app[TOKENS] = tokens
    app[SECURE] = secure
    app[THROTTLE] = throttle
    app[live.LIVE] = Counter()
    app.add_routes(
        [
            web.get("/signin", signin_page),
            web.post("/signin", signin),
            web.post("/signout", signout),
            web.get("/", page(pages.pool)),
            web.get("/jobs", page(pages.jobs)),
            web.get("/jobs/{job_id}", page(pages.job)),
            web.post("/jobs/{job_id}/cancel", action(pages.cancel)),
            web.get("/jobs/{job_id}/artifact", action(pages.artifact)),
            web.get("/jobs/{job_id}/log", live.log_events),
            web.get("/workers/{worker_id}", page(pages.worker)),
            web.get("/live/", live.page_events(pages.pool)),  # the live view of "/"
            web.get("/live/jobs", live.page_events(pages.jobs)),
            web.get("/live/jobs/{job_id}", live.page_events(pages.job)),
            web.get("/live/workers/{worker_id}", live.page_events(pages.worker)),
            web.static("/static", STATIC, append_version=False),
        ]
    )
    return app


class WebServer:
    """`start()` listens; `address` says where (a port 0 resolved); `stop()` is safe twice."""

    def __init__(
        self,
        handlers: Handlers,
        snapshots: Snapshots,
        tokens: Mapping[str, bytes] | None,
        host: str,
        port: int,
        *,
        tls: ssl.SSLContext | None,
        extra_hosts: list[str],
        throttle: Throttle | None = None,
    ) -> None:
        """`throttle`: failed sign-ins, shared with the protocol's listener (one guesser, one count)."""
        if tokens is None and host not in ("127.0.0.1", "::1", "localhost"):
            raise ListenerError(
                f"refusing to serve the dashboard on {host}:{port} without authentication: set tokens_file, "
                "or web_listen on 127.0.0.1"
            )
        self.snapshots = snapshots  # the pool view its pages share (bench/dashboard.py tunes its age)

        def machine() -> tuple[str, str]:
            return socket.gethostname(), socket.getfqdn()

        self._app = make_app(
            handlers,
            snapshots,
            tokens,
            host_names(host, extra_hosts, machine),
            secure=tls is not None,
            throttle=throttle or Throttle(),
        )
        self.sessions = self._app[SESSION_KEY]  # who is signed in (tests shrink its bounds)
        self._host, self._port, self._tls = host, port, tls
        self._runner: web.AppRunner | None = None
        self.port = port

    @property
    def address(self) -> str:
        scheme = "https" if self._tls is not None else "http"
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{scheme}://{host}:{self.port}"

    async def start(self) -> None:
        runner = web.AppRunner(
            self._app,
            access_log=None,
            shutdown_timeout=SHUTDOWN_GRACE,
            handler_cancellation=True,
            max_line_size=MAX_HEAD,
            max_field_size=MAX_HEAD,
            max_headers=MAX_HEADERS,
            keepalive_timeout=IDLE_SECONDS,  # also a connection that never sends a request
        )
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._port, ssl_context=self._tls)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise GpupoolError(
                f"the dashboard cannot listen on {self._host}:{self._port} ({exc.strerror}): set web_listen "
                'to a free HOST:PORT, or web_listen = "off"'
            ) from None
        self._runner = runner
        self.port = runner.addresses[0][1]  # the port it took, when asked for port 0

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
