"""What the server's and the worker's metrics share: a registry of their own, the process series,
bounded queue labels and the round-trip buckets.

Each daemon owns a `CollectorRegistry` rather than prometheus_client's global default one, so that
several daemons (or tests) can live in one process without "Duplicated timeseries" errors. Every
registry starts with the process series (under the standard `process_*` names every dashboard knows)
and `gpupool_build_info`.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Iterator

import psutil
from prometheus_client import CollectorRegistry, Info
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from daemon.queue.registry import version

log = logging.getLogger(__name__)

# Queue names come from users (any enqueue may name a new queue); past this many distinct ones,
# further queues share one label value so a typo loop cannot blow up the time-series count.
MAX_QUEUES = 100
OTHER_QUEUE = "_other"

# Round trips to Redis on one network: sub-millisecond to a few seconds when something is wrong.
RTT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class QueueLabels:
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


class ProcessCollector(Collector):
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


def new_registry(mode: str) -> CollectorRegistry:
    """A registry of its own for a daemon in `mode` ("server" or "worker"), with the process series
    and the build info already in it."""
    registry = CollectorRegistry()
    registry.register(ProcessCollector())
    Info("gpupool_build", "gpupool version and daemon mode.", registry=registry).info(
        {"version": version(), "mode": mode}
    )
    return registry
