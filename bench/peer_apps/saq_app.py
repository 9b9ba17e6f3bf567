"""SAQ: queue and worker settings (`saq bench.peer_apps.saq_app.settings`), defaults otherwise."""

from typing import Any

from saq import Queue

from bench.peer_apps import record, url

queue = Queue.from_url(url(), name="bench")


async def noop(ctx: Any, *, tag: str) -> None:
    record(tag)


settings = {"queue": queue, "functions": [noop]}
