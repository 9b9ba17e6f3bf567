"""A webhook receiver for the notification tests: a real HTTP server (aiohttp) on 127.0.0.1, in the
test's own event loop, that records every POST and answers as the test tells it, and the check of a
signature any receiver makes (docs/OPERATIONS.md §12)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Post:
    headers: dict[str, str]
    body: bytes
    answered: int
    at: float = field(default_factory=time.time)  # when it came (Unix seconds)

    @property
    def delivery(self) -> str:
        """What the POST delivers, `JOB/TARGET`, the same on every retry."""
        return self.headers["X-Gpupool-Delivery"]


@dataclass
class Receiver:
    """Answers each POST with the next of `answers` (200 once they run out), or with what `answer`
    says given the POSTs of the same delivery before it. While `hold` is set to an unset event, a
    POST is recorded on arrival and answered only once the event is set (a receiver that hangs)."""

    url: str
    answers: list[int]
    answer: Callable[[str, list[Post]], int] | None = None
    hold: asyncio.Event | None = None
    posts: list[Post] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_for(self, count: int, seconds: float = 30) -> list[Post]:
        """The first `count` POSTs, once they have come (TimeoutError after `seconds`)."""
        async with asyncio.timeout(seconds):
            while len(self.posts) < count:
                self.arrived.clear()
                await self.arrived.wait()
        return self.posts[:count]

    def of(self, delivery: str) -> list[Post]:
        """The POSTs of one delivery (`JOB/TARGET`), in the order they came."""
        return [p for p in self.posts if p.delivery == delivery]


@asynccontextmanager
async def receiver(
    answers: list[int] | None = None, answer: Callable[[str, list[Post]], int] | None = None
) -> AsyncIterator[Receiver]:
    hook = Receiver("", list(answers or []), answer)

    async def post(request: web.Request) -> web.Response:
        delivery = request.headers.get("X-Gpupool-Delivery", "")
        if hook.answer is not None:
            status = hook.answer(delivery, hook.of(delivery))
        else:
            status = hook.answers.pop(0) if hook.answers else 200
        hook.posts.append(Post(dict(request.headers), await request.read(), status))
        hook.arrived.set()
        if hook.hold is not None:
            await hook.hold.wait()
        return web.Response(status=status, text="ok" if status == 200 else "not now")

    app = web.Application()
    app.router.add_post("/hook/{token}", post)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    hook.url = f"http://{host}:{port}/hook/s3cr3t-path"
    try:
        yield hook
    finally:
        if hook.hold is not None:
            hook.hold.set()  # no request left hanging: the clean-up waits for them
        await runner.cleanup()


def signed(post: Post, secret: str | bytes, now: float | None = None) -> bool:
    """The receiver's check, as docs/OPERATIONS.md shows it: "v1=" + HMAC-SHA256 of the timestamp
    header, a dot and the raw body, and the timestamp within five minutes of `now` (default: when
    the POST came; a replay of an older one fails)."""
    key = secret.encode() if isinstance(secret, str) else secret
    timestamp = post.headers.get("X-Gpupool-Timestamp", "")
    if not timestamp.isdigit() or abs((post.at if now is None else now) - int(timestamp)) > 300:
        return False
    signed = timestamp.encode() + b"." + post.body
    expected = "v1=" + hmac.new(key, signed, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, post.headers.get("X-Gpupool-Signature", ""))


def user_key(token: str) -> bytes:
    """The key a user's own hooks are signed with, as docs/OPERATIONS.md tells a user to make it
    from their token: hex HMAC-SHA256 of "gpupool-webhook" keyed by the token."""
    return hmac.new(token.encode(), b"gpupool-webhook", hashlib.sha256).hexdigest().encode()
