"""The metrics endpoint: `GET /metrics` over HTTP, served by aiohttp's web server on the daemon's
own event loop.

`serve_for` serves a daemon's registry on its configured address (`metrics_listen`, or 127.0.0.1 on
the mode's fixed port) and turns a taken port into a GpupoolError that says which option to change;
`serve_metrics` serves any registry on any address (tests use port 0). Before each collection the
endpoint awaits the daemon's `before_scrape` (the server reads the pool state from Redis then).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial

from aiohttp import hdrs, web
from prometheus_client import CollectorRegistry, generate_latest

from daemon.address import parse_host_port
from daemon.aio import in_daemon_thread, start_or_undo
from daemon.config import Config
from daemon.errors import GpupoolError
from daemon.options import SERVER_METRICS_PORT, WORKER_METRICS_PORT

log = logging.getLogger(__name__)


def metrics_address(config: Config, *, worker: bool) -> tuple[str, int]:
    """`metrics_listen` as (host, port); empty means 127.0.0.1 on the mode's fixed port."""
    if not config.metrics_listen:
        return "127.0.0.1", WORKER_METRICS_PORT if worker else SERVER_METRICS_PORT
    return parse_host_port(config.metrics_listen)  # validated by config


# What generate_latest writes (names escaped to underscores): the classic text format every
# Prometheus reads. Not prometheus_client's CONTENT_TYPE_LATEST, which names 1.0.0 in newer releases.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The request head aiohttp's parser takes before it answers 400 (a scrape's head is a few hundred
# bytes): the request line, each header, and how many headers.
MAX_REQUEST_LINE = 8190
MAX_HEADER_FIELD = 8190
MAX_HEADERS = 32
# How long a connection may go without a whole request head (aiohttp's keepalive_timeout, armed
# from the connection's start since aiohttp 3.14.4): a peer that connects and dawdles is dropped.
REQUEST_TIMEOUT = 10.0
# How long a scrape waits for its collection (Prometheus gives up after 10 s by default) before it
# answers 503; the collection it waited for runs on in its thread.
COLLECT_TIMEOUT = 10.0
# close(): aiohttp waits this long for a scrape in flight before it cancels it (twice at most),
# and the whole cleanup is cut off at CLOSE_TIMEOUT whatever happens.
CLOSE_GRACE = 0.5
CLOSE_TIMEOUT = 3.0
ALLOW = "GET, HEAD"


class MetricsServer:
    """`GET /metrics` (and `HEAD`) on aiohttp's web server, one request per connection.

    Why not `prometheus_client.start_http_server`: it runs a threading WSGI server of its own, with
    daemon threads the daemon cannot stop cleanly. Why not prometheus_client's aiohttp handler: it
    collects on the event loop, where a hung NVML query would stop the daemon. This one closes with
    the daemon, takes port 0, and bounds what a hostile peer can make it hold (the request head,
    REQUEST_TIMEOUT).

    The collection (`generate_latest`) runs in a thread of its own, since NVML queries block and can
    hang on a failing GPU: the event loop, and so the systemd watchdog, never waits for it. Scrapes
    are serialised, and a scrape that gave up on a hung collection leaves it to the next one, which
    waits for that thread rather than start another: a hung collection holds one thread, however
    many scrapes come. The thread is a daemon thread, so it holds up neither close() nor the exit.
    """

    def __init__(
        self, registry: CollectorRegistry, before_scrape: Callable[[], Awaitable[None]] | None
    ) -> None:
        self._registry = registry
        self._before_scrape = before_scrape
        self._runner: web.AppRunner | None = None
        self._lock = asyncio.Lock()
        self._collection: asyncio.Future[bytes] | None = None  # the latest, done or still running
        self.host = ""
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        """Listen on host:port (0: a free one, read back from `.port`); OSError if it cannot."""
        app = web.Application()
        for path, get in (("/metrics", self._metrics), ("/", _index)):
            resource = app.router.add_resource(path)
            resource.add_route(hdrs.METH_GET, get)
            resource.add_route(hdrs.METH_HEAD, get)
            resource.add_route(hdrs.METH_ANY, _not_allowed)
        app.on_response_prepare.append(_close_after)
        self._runner = web.AppRunner(
            app,
            access_log=None,  # a scrape every few seconds is not news
            logger=log,  # a malformed request is logged as the metrics endpoint's, not aiohttp.server's
            keepalive_timeout=REQUEST_TIMEOUT,
            max_line_size=MAX_REQUEST_LINE,
            max_field_size=MAX_HEADER_FIELD,
            max_headers=MAX_HEADERS,
            shutdown_timeout=CLOSE_GRACE,
        )
        await start_or_undo(partial(self._listen, self._runner, host, port), self.close)
        log.info("metrics on http://%s:%d/metrics", host if ":" not in host else f"[{host}]", self.port)

    async def _listen(self, runner: web.AppRunner, host: str, port: int) -> None:
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        self.host, self.port = runner.addresses[0][:2]

    async def close(self) -> None:
        """Stop listening and drop open connections, within CLOSE_TIMEOUT even while a collection
        hangs (its thread is left to finish or die with the process). Safe to call twice."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT):
                await runner.cleanup()
        except TimeoutError:
            log.warning("metrics endpoint: cleanup still running after %gs; left to the exit", CLOSE_TIMEOUT)

    async def _metrics(self, request: web.Request) -> web.Response:
        try:
            async with asyncio.timeout(COLLECT_TIMEOUT):
                body = await self._collect()
        except TimeoutError:
            log.warning("metrics: no collection in %gs (a GPU query hanging?); answered 503", COLLECT_TIMEOUT)
            return web.Response(status=503, text="metrics collection timed out\n")
        return web.Response(body=body, headers={hdrs.CONTENT_TYPE: CONTENT_TYPE})

    async def _collect(self) -> bytes:
        async with self._lock:
            if self._collection is not None and not self._collection.done():
                # A scrape gave up on this one, which still holds its thread: wait for it rather
                # than take a second thread (asyncio.wait leaves it running if this one gives up).
                await asyncio.wait({self._collection})
            if self._before_scrape is not None:
                await self._before_scrape()
            self._collection = collection = in_daemon_thread(
                partial(generate_latest, self._registry), "gpupool-metrics-collect"
            )
            # Shielded: a scrape that gives up (timeout, close) leaves the collection to finish.
            return await asyncio.shield(collection)


async def _index(request: web.Request) -> web.Response:
    return web.Response(text="gpupool metrics: /metrics\n")


async def _not_allowed(request: web.Request) -> web.Response:
    return web.Response(status=405, text="method not allowed\n", headers={hdrs.ALLOW: ALLOW})


async def _close_after(request: web.Request, response: web.StreamResponse) -> None:
    """One request per connection: no idle kept-alive connection to hold, or for the next scrape
    to find closed under it. The header is set here as well: aiohttp (3.14) writes its own
    Connection header before this hook runs, so force_close() alone closes without saying so."""
    response.force_close()
    response.headers[hdrs.CONNECTION] = "close"


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
