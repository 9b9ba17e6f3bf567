"""Server-sent events that keep the pages live: no reload, no script but the page's own.

`page_events` renders a page's `live` block again every REFRESH seconds and sends it when it
changed; `log_events` streams a job's log as `poolctl logs -f` does (FollowLogs through the
handlers, as the signed-in user), each chunk with its offset as the event id, so a browser that
reconnects resumes where it was. A log stream holds a blocking Redis read, so it counts as one of
the user's blocking reads (the limits handlers.py sets for `logs -f` and `wait`); a page's stream
only polls the shared snapshot, and counts among the user's LIVE_PER_USER live pages instead. Both
end when the browser goes, when the session ends, or when the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections import Counter
from collections.abc import Iterator

from aiohttp import web
from markupsafe import Markup

from daemon.errors import GpupoolError
from daemon.server.web.guard import HEADERS, session_of, signed_in
from daemon.server.web.pages import HANDLERS, Handler, PageError, PageFunction, ask, may_act, refusal
from daemon.server.web.render import render_block
from protocol import FollowLogs, LogChunk, LogEnd, ShowJob, StreamItem

REFRESH = 2.0  # seconds between renders of a page's live block
LIVE_PER_USER = 16  # live pages one user may have open at once
LIVE_MOST = 512  # ... and all users together
LIVE = web.AppKey("live", Counter[str])  # user -> live pages open now
KEEPALIVE = 15.0  # seconds of silence after which a comment line checks the browser is there


async def _open(request: web.Request) -> web.StreamResponse:
    # Prepared here, before the guard sees the answer: the guard's headers must be set here too.
    response = web.StreamResponse(headers=HEADERS | {"Content-Type": "text/event-stream"})
    await response.prepare(request)
    return response


class SignedOut(ConnectionError):
    """The stream's session ended (sign-out, expiry): the stream ends as if the browser left."""


def _event(data: str, *, event: str | None = None, event_id: str | None = None) -> bytes:
    lines = [f"event: {event}"] if event else []
    lines += [f"id: {event_id}"] if event_id is not None else []
    # Every line end the format knows (a lone CR is one): a job's name with one must not end a
    # line of the event early and start a field of its own.
    lines += [f"data: {line}" for line in re.split(r"\r\n|\r|\n", data)]
    return ("\n".join(lines) + "\n\n").encode()


@contextlib.contextmanager
def live_view(request: web.Request) -> Iterator[None]:
    """Hold one of the user's LIVE_PER_USER live pages (and of everyone's LIVE_MOST) while the
    stream lasts. Its own budget: a page polls the shared snapshot and holds no Redis read, so it
    does not take from the user's `wait` and `logs -f` (a log stream does: handlers.py counts it)."""
    open_now, user = request.app[LIVE], signed_in(request).user
    if open_now.total() >= LIVE_MOST:
        raise web.HTTPTooManyRequests(
            text=f"the dashboard already serves {LIVE_MOST} live pages; retry soon\n"
        )
    if open_now[user] >= LIVE_PER_USER:
        raise web.HTTPTooManyRequests(
            text=f"{user} already has {LIVE_PER_USER} live pages open, the most one user may: close some\n"
        )
    open_now[user] += 1
    try:
        yield
    finally:
        open_now[user] -= 1
        if not open_now[user]:
            del open_now[user]


def page_events(page: PageFunction) -> Handler:
    """The event stream of `page`'s live block."""

    async def handler(request: web.Request) -> web.StreamResponse:
        with live_view(request):
            response = await _open(request)
            last, quiet = "", 0.0
            with contextlib.suppress(ConnectionError):
                while session_of(request) is not None:  # signed out, or expired: the stream ends
                    try:
                        template, context = await page(request)
                        html = render_block(request, template, "live", context)
                    except PageError as exc:
                        html = str(Markup("<p class=error>{}</p>").format(exc.message))
                    if html != last:
                        await response.write(_event(html))
                        last, quiet = html, 0.0
                    elif (quiet := quiet + REFRESH) >= KEEPALIVE:
                        await response.write(b": still here\n\n")
                        quiet = 0.0
                    await asyncio.sleep(REFRESH)
            return response

    return handler


async def log_events(request: web.Request) -> web.StreamResponse:
    job_id = request.match_info["job_id"]
    offset = request.headers.get("Last-Event-ID", "")
    try:  # refused as a plain HTTP error before the stream opens: not found, not yours
        owner = str((await ask(request, ShowJob(job_id))).job.get("spec", {}).get("user", ""))
    except PageError as exc:
        raise refusal(exc) from None
    if not may_act(request, owner):
        raise web.HTTPForbidden(
            text=f"job {job_id} belongs to {owner}: only its owner or a pool admin may read its log\n"
        )
    try:  # at the user's limit of blocking reads: refused as an HTTP error, not a stream's event
        with request.app[HANDLERS].blocking_read(signed_in(request).user):
            pass  # a look only: following the log below holds one for as long as it lasts
    except GpupoolError as exc:
        raise web.HTTPTooManyRequests(text=exc.message + "\n") from None
    response = await _open(request)  # open now: a job that prints nothing yet still has a stream

    async def send(item: StreamItem) -> None:
        if session_of(request) is None:
            raise SignedOut
        if isinstance(item, LogChunk):
            text = item.data.decode("utf-8", "replace")
            await response.write(_event(json.dumps(text), event="log", event_id=item.offset))

    with contextlib.suppress(ConnectionError):
        try:
            end: LogEnd = await ask(request, FollowLogs(job_id, True, offset), send)
        except PageError as exc:
            await response.write(_event(json.dumps(exc.message), event="failed"))
            return response
        ended = end.state + (f", exit {end.exit_code}" if end.exit_code is not None else "")
        await response.write(_event(json.dumps(ended), event="end"))
    return response
