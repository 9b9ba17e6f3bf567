"""The server's metrics: what it sees happen (enqueues, ends, reclaims, connections, protocol errors)
and the pool's state (queue depth, workers, slots), asked of Redis at scrape time.

What is counted where it happens (a job is enqueued or ends, an ERROR frame is sent) is a counter or
histogram updated in place by the typed methods of `ServerMetrics`. What is a state of the pool is
asked of Redis at scrape time instead, through `ServerMetrics.refresh`, which the endpoint awaits
before each scrape: it costs nothing when nobody scrapes, is never staler than the scrape, and needs
no extra background task. Its result is swapped in as one immutable snapshot, so a scrape never sees
half an update. Each refresh also times one Redis round trip (`gpupool_redis_roundtrip_seconds`).

Job starts are not counted here: a worker claims from Redis directly, so the server never sees a
start; each worker counts its own (`gpupool_jobs_started_total`, metrics/worker.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from daemon.job import TERMINAL_STATES, JobState
from daemon.metrics.common import RTT_BUCKETS, QueueLabels, new_registry
from daemon.queue.registry import DEAD, DRAINING, HEALTHY
from protocol.errors import ErrorCode

log = logging.getLogger(__name__)

# How long a scrape waits for Redis before it serves the last known pool state.
REFRESH_TIMEOUT = 5.0

# Training jobs wait and run for anything from a second to days.
WAIT_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 28800, 86400, 172800, 604800)
RUN_BUCKETS = (1, 10, 60, 300, 600, 1800, 3600, 7200, 14400, 28800, 57600, 86400, 172800, 345600, 604800)
NOTIFICATION_OUTCOMES = ("sent", "failed", "dropped", "refused")


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
        self.registry = new_registry("server")
        r = self.registry
        self._queue = QueueLabels()
        self._state = _PoolStateCollector()
        r.register(self._state)
        self._enqueued = Counter("gpupool_jobs_enqueued", "Jobs accepted.", ["queue"], registry=r)
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
        self._notifications = Counter(
            "gpupool_notifications",
            "Job-end notifications (--notify, notify_url) by outcome: sent (answered 2xx), failed (given "
            "up after its retries, or refused), dropped (pushed out of a full outbox, or its job's record "
            "expired before it was sent), refused (a user's hook to an address notify_allow does not allow: "
            "never attempted, so it says nothing of whether the address answers).",
            ["outcome"],
            registry=r,
        )
        for outcome in NOTIFICATION_OUTCOMES:  # each series from 0, for rate() and alerts
            self._notifications.labels(outcome)
        self._depth_source: DepthSource | None = None
        self._workers_source: WorkersSource | None = None
        self._failing = False

    # -- events, recorded where they happen --

    def job_enqueued(self, queue: str, count: int = 1) -> None:
        self._enqueued.labels(self._queue(queue)).inc(count)

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

    def notification(self, outcome: str, count: int = 1) -> None:
        """`count` job-end notifications were sent, failed or dropped (server/notifier.py)."""
        if outcome not in NOTIFICATION_OUTCOMES:
            raise ValueError(f"{outcome!r} is not one of {', '.join(NOTIFICATION_OUTCOMES)}")
        self._notifications.labels(outcome).inc(count)

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
