"""The metrics endpoint: `GET /metrics` over HTTP on the daemon's own event loop.

`serve_for` serves a daemon's registry on its configured address (`metrics_listen`, or 127.0.0.1 on
the mode's fixed port) and turns a taken port into a GpupoolError that says which option to change;
`serve_metrics` serves any registry on any address (tests use port 0). Before each collection the
endpoint awaits the daemon's `before_scrape` (the server reads the pool state from Redis then).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from daemon.address import parse_host_port
from daemon.aio import cancel_and_wait
from daemon.config import SERVER_METRICS_PORT, WORKER_METRICS_PORT, Config
from daemon.errors import GpupoolError

log = logging.getLogger(__name__)


def metrics_address(config: Config, *, worker: bool) -> tuple[str, int]:
    """`metrics_listen` as (host, port); empty means 127.0.0.1 on the mode's fixed port."""
    if not config.metrics_listen:
        return "127.0.0.1", WORKER_METRICS_PORT if worker else SERVER_METRICS_PORT
    return parse_host_port(config.metrics_listen)  # validated by config


# What generate_latest writes (names escaped to underscores): the classic text format every
# Prometheus reads. Not prometheus_client's CONTENT_TYPE_LATEST, which names 1.0.0 in newer releases.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_REQUEST_HEAD = 8192
REQUEST_TIMEOUT = 10.0
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


class MetricsServer:
    """A minimal HTTP/1.1 server for `GET /metrics`, one request per connection.

    Why not `prometheus_client.start_http_server`: it runs a threading WSGI server of its own, with
    daemon threads the daemon cannot stop cleanly and (before 0.20) no handle to read a port 0
    back. This one is a few lines on the daemon's own event loop: it closes with the daemon, takes
    port 0, and bounds what a hostile peer can make it buffer (8 KiB of request head, 10 s). The
    collection itself (`generate_latest`) runs in a worker thread, since NVML queries block and can
    hang on a failing GPU; the event loop, and so the systemd watchdog, never waits for it. Scrapes
    are serialised, so a hung collection holds one thread, not one per scrape.
    """

    def __init__(
        self, registry: CollectorRegistry, before_scrape: Callable[[], Awaitable[None]] | None
    ) -> None:
        self._registry = registry
        self._before_scrape = before_scrape
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self._lock = asyncio.Lock()
        self.host = ""
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_REQUEST_HEAD)
        self.host, self.port = self._server.sockets[0].getsockname()[:2]
        log.info("metrics on http://%s:%d/metrics", host if ":" not in host else f"[{host}]", self.port)

    async def close(self) -> None:
        """Stop listening and drop open connections. Safe to call twice."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._handlers):
            await cancel_and_wait(task)
        await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
                status, headers, body = await self._respond(head)
                lines = [f"HTTP/1.1 {status} {_REASONS[status]}", *headers]
                lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
                writer.write("\r\n".join(lines).encode("latin-1"))
                if not head.startswith(b"HEAD "):
                    writer.write(body)
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass  # a peer that hangs up, dawdles or sends an oversized head gets no answer
        finally:
            if task is not None:
                self._handlers.discard(task)
            writer.close()

    async def _respond(self, head: bytes) -> tuple[int, list[str], bytes]:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return 400, [], b"bad request\n"
        method, path = parts[0], parts[1].split(b"?", 1)[0]
        if path not in (b"/metrics", b"/"):
            return 404, [], b"not found: try /metrics\n"
        if method not in (b"GET", b"HEAD"):
            return 405, ["Allow: GET, HEAD"], b"method not allowed\n"
        if path == b"/":
            return 200, ["Content-Type: text/plain; charset=utf-8"], b"gpupool metrics: /metrics\n"
        async with self._lock:
            if self._before_scrape is not None:
                await self._before_scrape()
            body = await asyncio.to_thread(generate_latest, self._registry)
        return 200, [f"Content-Type: {CONTENT_TYPE}"], body


async def serve_metrics(
    registry: CollectorRegistry,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    before_scrape: Callable[[], Awaitable[None]] | None = None,
) -> MetricsServer:
    """Serve `registry` on http://host:port/metrics (port 0: a free port, read it from `.port`).
    `before_scrape` (e.g. `ServerMetrics.refresh`) is awaited before each collection. Close with
    `await server.close()`."""
    server = MetricsServer(registry, before_scrape)
    await server.start(host, port)
    return server


async def serve_for(
    registry: CollectorRegistry, config: Config, *, worker: bool, before_scrape: Callable[[], Awaitable[None]]
) -> MetricsServer:
    """Serve a daemon's metrics on its configured address; a taken port is a GpupoolError that says
    which option to change."""
    host, port = metrics_address(config, worker=worker)
    try:
        return await serve_metrics(registry, host, port, before_scrape=before_scrape)
    except OSError as exc:
        raise GpupoolError(
            f"cannot serve metrics on {host}:{port} ({exc.strerror}): set metrics_listen to a free HOST:PORT"
        ) from None
