"""Prometheus metrics: one registry per daemon, typed methods to record, and an asyncio endpoint.

Callers never touch prometheus_client objects: the server records through `ServerMetrics`, a worker
through `WorkerMetrics` (`job_finished(queue, state, wait_s, run_s)`, `heartbeat(rtt_s)`, ...). Each
owns a `CollectorRegistry` of its own rather than the global default one, so that several daemons
(or tests) can live in one process without "Duplicated timeseries" errors.

Names follow Prometheus conventions: a `gpupool_` prefix, base units (`_seconds`, `_bytes`, ratios
from 0 to 1 rather than percent), `_total` on counters. Label values are bounded: queue names (and at
most `MAX_QUEUES` of those, the rest are summed under `"_other"`), terminal states, error code names,
GPU indexes; never job or worker ids. The process metrics keep the standard `process_*` names every
dashboard already knows.

What is counted where it happens (a job ends, a heartbeat returns) is a counter or histogram updated
in place. What is a state of the pool (queue depth, workers by health, slots) is asked of Redis
at scrape time instead, through `ServerMetrics.refresh`, which `serve_metrics` awaits before each
scrape: it costs nothing when nobody scrapes, is never staler than the scrape, and needs no extra
background task. Its result is swapped in as one immutable snapshot, so a scrape never sees half
an update. Each refresh also times one Redis round trip (`gpupool_redis_roundtrip_seconds`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import psutil
import pynvml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from daemon.address import parse_host_port
from daemon.aio import cancel_and_wait
from daemon.config import SERVER_METRICS_PORT, WORKER_METRICS_PORT, Config
from daemon.errors import GpupoolError
from daemon.job import TERMINAL_STATES, JobState
from daemon.queue.registry import DEAD, DRAINING, HEALTHY, version
from protocol.errors import ErrorCode

log = logging.getLogger(__name__)

# Queue names come from users (any enqueue may name a new queue); past this many distinct ones,
# further queues share one label value so a typo loop cannot blow up the time-series count.
MAX_QUEUES = 100
OTHER_QUEUE = "_other"
# How long a scrape waits for Redis before it serves the last known pool state.
REFRESH_TIMEOUT = 5.0

# Training jobs wait and run for anything from a second to days.
WAIT_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 28800, 86400, 172800, 604800)
RUN_BUCKETS = (1, 10, 60, 300, 600, 1800, 3600, 7200, 14400, 28800, 57600, 86400, 172800, 345600, 604800)
# Round trips to Redis on one network: sub-millisecond to a few seconds when something is wrong.
RTT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
TRANSFER_DIRECTIONS = ("upload", "download")


class _QueueLabels:
    """The label value for a queue name, with at most MAX_QUEUES distinct ones."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __call__(self, queue: str) -> str:
        if queue in self._seen:
            return queue
        if len(self._seen) < MAX_QUEUES:
            self._seen.add(queue)
            return queue
        if len(self._seen) == MAX_QUEUES:
            self._seen.add(OTHER_QUEUE)  # warn once
            log.warning(
                "more than %d queues: metrics of further queues are summed as %r", MAX_QUEUES, OTHER_QUEUE
            )
        return OTHER_QUEUE


class _ProcessCollector(Collector):
    """This process's CPU time, memory and file descriptors via psutil, under the standard names
    of prometheus_client's own ProcessCollector (which reads /proc and so works on Linux only)."""

    def __init__(self) -> None:
        self._process = psutil.Process()

    def collect(self) -> Iterator[Metric]:
        p = self._process
        with p.oneshot():
            cpu = p.cpu_times()
            memory = p.memory_info()
            started = p.create_time()
            fds = p.num_fds() if hasattr(p, "num_fds") else None
        yield CounterMetricFamily(
            "process_cpu_seconds", "User and system CPU time spent in seconds.", cpu.user + cpu.system
        )
        yield GaugeMetricFamily("process_resident_memory_bytes", "Resident memory size in bytes.", memory.rss)
        yield GaugeMetricFamily("process_virtual_memory_bytes", "Virtual memory size in bytes.", memory.vms)
        yield GaugeMetricFamily(
            "process_start_time_seconds", "Start time of the process since unix epoch in seconds.", started
        )
        if fds is not None:
            yield GaugeMetricFamily("process_open_fds", "Number of open file descriptors.", fds)
            yield GaugeMetricFamily(
                "process_max_fds",
                "Maximum number of open file descriptors.",
                resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            )


def _new_registry(mode: str) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_ProcessCollector())
    Info("gpupool_build", "gpupool version and daemon mode.", registry=registry).info(
        {"version": version(), "mode": mode}
    )
    return registry


# -- server ----------------------------------------------------------------------------------------


class DepthSource(Protocol):
    """What the server's refresh asks at scrape time (JobQueue is one)."""

    async def queues(self) -> list[str]: ...

    async def depths(self, queues: Sequence[str]) -> dict[str, int]: ...


WorkersSource = Callable[[], Awaitable[Sequence[Mapping[str, Any]]]]


class _PoolStateCollector(Collector):
    """Queue depth, workers by health and slots by state, from the last refresh's snapshot."""

    def __init__(self) -> None:
        self.depths: Mapping[str, int] | None = None
        self.workers: Mapping[str, int] | None = None
        self.slots: Mapping[str, int] | None = None

    def collect(self) -> Iterator[Metric]:
        depths, workers, slots = self.depths, self.workers, self.slots  # one consistent read each
        if depths is not None:
            family = GaugeMetricFamily(
                "gpupool_queue_depth", "Jobs waiting to start, per queue.", labels=["queue"]
            )
            for queue, depth in sorted(depths.items()):
                family.add_metric([queue], depth)
            yield family
        if workers is not None:
            family = GaugeMetricFamily(
                "gpupool_pool_workers", "Registered workers by health.", labels=["state"]
            )
            for state, count in workers.items():
                family.add_metric([state], count)
            yield family
        if slots is not None:
            family = GaugeMetricFamily(
                "gpupool_pool_slots",
                "Slots of live workers: busy (running a job) or free (on healthy workers).",
                labels=["state"],
            )
            for state, count in slots.items():
                family.add_metric([state], count)
            yield family


class ServerMetrics:
    """The server's metrics. Counters and histograms are recorded by the typed methods; the pool
    state (queue depth, workers, slots, Redis round trip) is refreshed at scrape time from the
    sources given to `watch`."""

    def __init__(self) -> None:
        self.registry = _new_registry("server")
        r = self.registry
        self._queue = _QueueLabels()
        self._state = _PoolStateCollector()
        r.register(self._state)
        self._enqueued = Counter("gpupool_jobs_enqueued", "Jobs accepted.", ["queue"], registry=r)
        self._started = Counter("gpupool_jobs_started", "Job attempts started.", ["queue"], registry=r)
        self._finished = Counter(
            "gpupool_jobs_finished", "Jobs that reached a terminal state.", ["queue", "state"], registry=r
        )
        self._dead = Counter(
            "gpupool_jobs_dead_lettered",
            "Jobs given up on after losing max_attempts attempts to dead workers.",
            ["queue"],
            registry=r,
        )
        self._reclaimed = Counter(
            "gpupool_attempts_reclaimed",
            "Attempts taken back from dead workers and put at the front of their queue.",
            ["queue"],
            registry=r,
        )
        self._wait = Histogram(
            "gpupool_job_wait_seconds",
            "Time from enqueue to start, of finished jobs that started.",
            ["queue"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self._run = Histogram(
            "gpupool_job_run_seconds",
            "Time from start to end, of finished jobs that started.",
            ["queue"],
            buckets=RUN_BUCKETS,
            registry=r,
        )
        self._connections = Gauge("gpupool_protocol_connections", "Open client connections.", registry=r)
        self._protocol_errors = Counter(
            "gpupool_protocol_errors", "ERROR frames sent, by code.", ["code"], registry=r
        )
        self._redis_rtt = Histogram(
            "gpupool_redis_roundtrip_seconds",
            "Round trip of one Redis command, timed at each scrape.",
            buckets=RTT_BUCKETS,
            registry=r,
        )
        self._refresh_failures = Counter(
            "gpupool_metrics_refresh_failures",
            "Scrapes that could not read the pool state from Redis (the last known one was served).",
            registry=r,
        )
        self._depth_source: DepthSource | None = None
        self._workers_source: WorkersSource | None = None
        self._failing = False

    # -- events, recorded where they happen --

    def job_enqueued(self, queue: str, count: int = 1) -> None:
        self._enqueued.labels(self._queue(queue)).inc(count)

    def job_started(self, queue: str) -> None:
        self._started.labels(self._queue(queue)).inc()

    def job_finished(
        self, queue: str, state: JobState | str, wait_s: float | None = None, run_s: float | None = None
    ) -> None:
        """A job reached terminal `state` (succeeded, failed, cancelled, dead). `wait_s` (enqueue to
        start) and `run_s` (start to end) are None for a job that never started."""
        state = str(state)
        if state not in TERMINAL_STATES:
            raise ValueError(f"{state!r} is not a terminal state")
        q = self._queue(queue)
        self._finished.labels(q, state).inc()
        if state == JobState.DEAD:
            self._dead.labels(q).inc()
        if wait_s is not None:
            self._wait.labels(q).observe(max(0.0, wait_s))
        if run_s is not None:
            self._run.labels(q).observe(max(0.0, run_s))

    def attempts_reclaimed(self, queue: str, count: int = 1) -> None:
        self._reclaimed.labels(self._queue(queue)).inc(count)

    def connection_opened(self) -> None:
        self._connections.inc()

    def connection_closed(self) -> None:
        self._connections.dec()

    def protocol_error(self, code: ErrorCode | str) -> None:
        """An ERROR frame was sent; `code` is the ErrorCode (or its name)."""
        if not isinstance(code, ErrorCode):
            try:
                code = ErrorCode[code.upper()]
            except KeyError:
                raise ValueError(f"{code!r} is not an ErrorCode name") from None
        self._protocol_errors.labels(code.name.lower()).inc()

    def redis_roundtrip(self, seconds: float) -> None:
        self._redis_rtt.observe(seconds)

    # -- pool state, refreshed at scrape time --

    def watch(self, queue: DepthSource, workers: WorkersSource | None = None) -> None:
        """Ask `queue` for the queues and their depth, and `workers()` (records as
        registry.list_workers returns them) for workers and slots, at every scrape."""
        self._depth_source = queue
        self._workers_source = workers

    def set_workers(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Workers by health and slots by state, from worker records (`health`, `slots`,
        `running`). Busy slots count on live workers; free ones on healthy workers only, since a
        draining worker takes no new job."""
        workers = dict.fromkeys((HEALTHY, DRAINING, DEAD), 0)
        busy = free = 0
        for record in records:
            health = str(record.get("health", record.get("state", HEALTHY)))
            workers[health] = workers.get(health, 0) + 1
            if health == DEAD:
                continue
            slots, running = int(record.get("slots", 0)), int(record.get("running", 0))
            busy += running
            if health == HEALTHY:
                free += max(0, slots - running)
        self._state.workers = workers
        self._state.slots = {"busy": busy, "free": free}

    def set_queue_depths(self, depths: Mapping[str, int]) -> None:
        bounded: dict[str, int] = {}
        for queue, depth in depths.items():
            label = self._queue(queue)
            bounded[label] = bounded.get(label, 0) + depth
        self._state.depths = bounded

    async def refresh(self) -> None:
        """Read the pool state from the watched sources. On a Redis error or timeout the last known
        state is served and `gpupool_metrics_refresh_failures_total` counts the miss."""
        source, workers = self._depth_source, self._workers_source
        if source is None and workers is None:
            return
        try:
            async with asyncio.timeout(REFRESH_TIMEOUT):
                if source is not None:
                    sent = time.perf_counter()
                    queues = await source.queues()
                    self.redis_roundtrip(time.perf_counter() - sent)
                    self.set_queue_depths(await source.depths(queues))
                if workers is not None:
                    self.set_workers(await workers())
        except (RedisError, OSError, TimeoutError) as exc:
            self._refresh_failures.inc()
            if not self._failing:
                log.warning("metrics: cannot read the pool state (%r); serving the last known one", exc)
            self._failing = True
            return
        if self._failing:
            log.info("metrics: reading the pool state again")
            self._failing = False


# -- worker ----------------------------------------------------------------------------------------


class Gpu(Protocol):
    """A GPU as the worker knows it (daemon.worker.gpus.GpuInfo is one)."""

    @property
    def index(self) -> int: ...

    @property
    def uuid(self) -> str: ...


class _GpuCollector(Collector):
    """Per-GPU utilisation, memory and temperature, asked of NVML at scrape time (which
    `serve_metrics` runs in a thread, so a slow driver never stalls the event loop). A GPU or a
    query NVML cannot answer (no driver, MIG mode, a GPU fallen off the bus) yields no sample;
    no GPU yields no family at all."""

    def __init__(self, gpus: Sequence[Gpu], quarantined: Callable[[], Collection[str]]) -> None:
        self._gpus = tuple(gpus)
        self._quarantined = quarantined

    def collect(self) -> Iterator[Metric]:
        labels = ["gpu", "uuid"]
        util = GaugeMetricFamily("gpupool_gpu_utilization_ratio", "GPU busy time (0-1).", labels=labels)
        used = GaugeMetricFamily("gpupool_gpu_memory_used_bytes", "GPU memory in use.", labels=labels)
        total = GaugeMetricFamily("gpupool_gpu_memory_total_bytes", "GPU memory in all.", labels=labels)
        temp = GaugeMetricFamily("gpupool_gpu_temperature_celsius", "GPU core temperature.", labels=labels)
        quarantine = GaugeMetricFamily(
            "gpupool_gpu_quarantined",
            "1 if the GPU is quarantined (left dirty by a job), else 0.",
            labels=labels,
        )
        quarantined = self._quarantined()
        for gpu in self._gpus:
            values = [str(gpu.index), gpu.uuid]
            quarantine.add_metric(values, 1 if gpu.uuid in quarantined else 0)
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            except pynvml.NVMLError:
                continue
            # A query NVML cannot answer (not supported, e.g. utilisation in MIG mode, or a transient
            # error) leaves that sample out of this scrape.
            with contextlib.suppress(pynvml.NVMLError):
                util.add_metric(values, pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100)
            with contextlib.suppress(pynvml.NVMLError):
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                used.add_metric(values, memory.used)
                total.add_metric(values, memory.total)
            with contextlib.suppress(pynvml.NVMLError):
                temp.add_metric(values, pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
        for family in (util, used, total, temp, quarantine):
            if family.samples:
                yield family


class WorkerMetrics:
    """A worker's metrics. `gpus` are the GPUs discovery found (none on a CPU worker); NVML must be
    initialised for their live series (daemon.worker.gpus.discover leaves it so when it finds GPUs)."""

    def __init__(self, gpus: Sequence[Gpu] = ()) -> None:
        self.registry = _new_registry("worker")
        r = self.registry
        self._quarantined: frozenset[str] = frozenset()
        r.register(_GpuCollector(gpus, lambda: self._quarantined))
        self._slots = Gauge("gpupool_worker_slots", "This worker's slots by state.", ["state"], registry=r)
        self.set_slots(0, 0)
        self._quarantined_count = Gauge(
            "gpupool_worker_gpus_quarantined", "GPUs this worker holds back as dirty.", registry=r
        )
        self._heartbeat = Histogram(
            "gpupool_heartbeat_roundtrip_seconds",
            "Round trip of a successful heartbeat (registration and lease renewals).",
            buckets=RTT_BUCKETS,
            registry=r,
        )
        self._heartbeat_failures = Counter(
            "gpupool_heartbeat_failures", "Heartbeats that failed (Redis unreachable).", registry=r
        )
        self._transferred = Counter(
            "gpupool_transfer_bytes", "Bytes moved to and from the object store.", ["direction"], registry=r
        )
        for direction in TRANSFER_DIRECTIONS:
            self._transferred.labels(direction)  # present at 0 from the start

    def set_slots(self, busy: int, total: int) -> None:
        self._slots.labels("busy").set(busy)
        self._slots.labels("free").set(max(0, total - busy))

    def set_quarantined(self, uuids: Collection[str]) -> None:
        """The UUIDs of the GPUs now quarantined (the whole set, not a change)."""
        self._quarantined = frozenset(uuids)
        self._quarantined_count.set(len(self._quarantined))

    def heartbeat(self, rtt_s: float) -> None:
        self._heartbeat.observe(rtt_s)

    def heartbeat_failed(self) -> None:
        self._heartbeat_failures.inc()

    def transferred(self, direction: str, nbytes: int) -> None:
        """`direction` is "upload" (to the object store) or "download"."""
        if direction not in TRANSFER_DIRECTIONS:
            raise ValueError(f"direction must be one of {TRANSFER_DIRECTIONS}, not {direction!r}")
        self._transferred.labels(direction).inc(nbytes)

    async def refresh(self) -> None:
        """Nothing to ask before a scrape: GPUs and the process are read by their collectors."""


# -- the HTTP endpoint -----------------------------------------------------------------------------


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
