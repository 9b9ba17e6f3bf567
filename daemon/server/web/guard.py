"""What every dashboard request passes before a page sees it, in this order:

1. The Host header must name this server (`hosts`): a page from a hostile site that rebinds its
   own name to this address (DNS rebinding) sends that name, and is refused before anything.
2. Every answer carries a strict Content-Security-Policy (scripts, styles and connections from
   this server only, no inline script, no framing) and no-sniff / no-referrer headers.
3. Pages need a signed-in session (signin.py), except the sign-in page and the static files; a
   browser without one is sent to sign in, a script (an event stream) gets 401.
4. Every POST carries the session's CSRF token, and an Origin, when the browser sends one, that is
   this server's own, port included (another service on the same host is another site). The
   session cookie is SameSite=Strict as well: either alone would do.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import quote

from aiohttp import web
from aiohttp.typedefs import Middleware

from daemon.server.web.signin import COOKIE, Session, Sessions, same

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # not no-referrer: the browser would send `Origin: null`
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
OPEN_PATHS = ("/signin", "/static/")  # reachable without a session
SESSION_KEY = web.AppKey("sessions", Sessions)
SIGNED_IN = web.RequestKey("session", Session)  # set on a request the guard let through
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def host_names(
    listen_host: str, extra: Iterable[str], machine: Callable[[], Iterable[str]]
) -> frozenset[str]:
    """The names the dashboard answers to: loopback's, the host it listens on, the machine's own
    names when it listens on every address, and `extra` (the `web_hosts` option)."""
    names = {"localhost", "127.0.0.1", "::1", listen_host.lower(), *(e.lower().strip("[]") for e in extra)}
    if listen_host in ("0.0.0.0", "::", ""):  # noqa: S104 - a comparison, not a binding
        names |= {m.lower() for m in machine()}  # asked only then: getfqdn may wait for DNS
    return frozenset(names)


def host_of(header: str) -> str:
    """The name in a Host header, without its port or an IPv6 address's brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    name, _, port = header.rpartition(":")
    if name and port.isdigit():
        try:
            ipaddress.IPv6Address(header)  # an unbracketed IPv6 address has colons of its own
            return header
        except ValueError:
            return name
    return header


def session_of(request: web.Request) -> Session | None:
    return request.app[SESSION_KEY].get(request.cookies.get(COOKIE))


def signed_in(request: web.Request) -> Session:
    """The request's session (the guard let it through, so there is one)."""
    return request[SIGNED_IN]


def guard(hosts: frozenset[str]) -> Middleware:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await _checked(request, handler, hosts)
        except web.HTTPException as exc:  # a refusal or a redirect, as an answer of its own
            response = web.Response(status=exc.status, reason=exc.reason, text=exc.text, headers=exc.headers)
        for name, value in HEADERS.items():
            response.headers.setdefault(name, value)
        return response

    return middleware


async def _checked(request: web.Request, handler: Handler, hosts: frozenset[str]) -> web.StreamResponse:
    if host_of(request.host) not in hosts:
        raise web.HTTPMisdirectedRequest(text=f"this server does not answer for the host {request.host!r}\n")
    origin = request.headers.get("Origin")  # the page a form came from: this server, port and all
    if (
        request.method == "POST"
        and origin is not None
        and origin.partition("://")[2].lower() != request.host.lower()
    ):
        raise web.HTTPForbidden(text="a form from another site\n")
    if request.path.startswith(OPEN_PATHS):
        return await handler(request)
    session = session_of(request)
    if session is None:
        if request.method == "GET" and "text/event-stream" not in request.headers.get("Accept", ""):
            # quoted: the page's own query (`?user=a&state=b`) must come back whole, not split
            raise web.HTTPSeeOther(f"/signin?next={quote(request.path_qs, safe='/')}")
        raise web.HTTPUnauthorized(text="sign in first\n")
    if request.method == "POST":
        form = await request.post()
        if not same(str(form.get("csrf", "")), session.csrf):
            raise web.HTTPForbidden(text="this form is stale or not from this dashboard: reload the page\n")
    request[SIGNED_IN] = session
    return await handler(request)
