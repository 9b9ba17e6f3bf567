"""Metrics: recorded through the typed methods, scraped over real loopback HTTP, parsed with
prometheus_client's own parser."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Metric
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from daemon import config
from daemon.errors import GpupoolError
from daemon.job import JobSpec, JobState
from daemon.metrics import common, endpoint
from daemon.metrics import server as server_module
from daemon.metrics.endpoint import MetricsServer, metrics_address, serve_for, serve_metrics
from daemon.metrics.server import RUN_BUCKETS, ServerMetrics
from daemon.metrics.worker import GpuSample, GpuShare, WorkerMetrics
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.worker import gpus
from protocol.errors import ErrorCode

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def http(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP exchange with 127.0.0.1:port: (status, headers, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


GET_METRICS = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n"


async def scrape(server: MetricsServer) -> tuple[set[str], Samples]:
    """GET /metrics: the family names and every sample by (name, labels)."""
    status, headers, body = await http(server.port, GET_METRICS)
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    assert int(headers["content-length"]) == len(body)
    families, samples = set(), {}
    for family in text_string_to_metric_families(body.decode()):
        families.add(family.name)
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return families, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
async def server_metrics() -> AsyncIterator[tuple[ServerMetrics, MetricsServer]]:
    metrics = ServerMetrics()
    server = await serve_metrics(metrics.registry, "127.0.0.1", 0, before_scrape=metrics.refresh)
    yield metrics, server
    await server.close()


async def test_server_metrics(server_metrics: tuple[ServerMetrics, MetricsServer]) -> None:
    metrics, server = server_metrics
    assert server.port > 0
    metrics.job_enqueued("default", 3)
    metrics.job_enqueued("gpu")
    metrics.job_finished("default", JobState.SUCCEEDED, wait_s=2.0, run_s=30.0)
    metrics.job_finished("default", "failed", wait_s=100.0, run_s=7200.0)
    metrics.job_finished("default", JobState.CANCELLED)  # cancelled while queued: never ran
    metrics.job_finished("gpu", JobState.DEAD, wait_s=1.0, run_s=5.0)
    metrics.attempts_reclaimed("gpu", 2)
    metrics.connection_opened()
    metrics.connection_opened()
    metrics.connection_closed()
    metrics.protocol_error(ErrorCode.FRAME_TOO_LARGE)
    metrics.protocol_error("auth_failed")
    metrics.redis_roundtrip(0.002)

    families, samples = await scrape(server)
    assert value(samples, "gpupool_jobs_enqueued_total", queue="default") == 3
    assert value(samples, "gpupool_jobs_enqueued_total", queue="gpu") == 1
    assert "gpupool_jobs_started" not in families  # the server never sees a start: workers count them
    for state, count in [("succeeded", 1), ("failed", 1), ("cancelled", 1)]:
        assert value(samples, "gpupool_jobs_finished_total", queue="default", state=state) == count
    assert value(samples, "gpupool_jobs_finished_total", queue="gpu", state="dead") == 1
    assert value(samples, "gpupool_jobs_dead_lettered_total", queue="gpu") == 1
    assert value(samples, "gpupool_attempts_reclaimed_total", queue="gpu") == 2
    assert value(samples, "gpupool_protocol_connections") == 1
    assert value(samples, "gpupool_protocol_errors_total", code="frame_too_large") == 1
    assert value(samples, "gpupool_protocol_errors_total", code="auth_failed") == 1
    # Histograms count every finished job that ran, in the right buckets.
    assert value(samples, "gpupool_job_wait_seconds_count", queue="default") == 2
    assert value(samples, "gpupool_job_wait_seconds_sum", queue="default") == 102
    assert value(samples, "gpupool_job_run_seconds_count", queue="default") == 2
    assert value(samples, "gpupool_job_run_seconds_bucket", queue="default", le="60.0") == 1
    assert value(samples, "gpupool_job_run_seconds_bucket", queue="default", le="7200.0") == 2
    assert value(samples, "gpupool_job_run_seconds_bucket", queue="default", le="+Inf") == 2
    assert float(RUN_BUCKETS[-1]) >= 7 * 86400  # training runs last days
    assert value(samples, "gpupool_redis_roundtrip_seconds_count") == 1
    ((build, one),) = [(dict(labels), v) for (n, labels), v in samples.items() if n == "gpupool_build_info"]
    assert (build["mode"], one) == ("server", 1)
    assert build["version"]
    # The process, via psutil, under the standard names.
    assert value(samples, "process_cpu_seconds_total") > 0
    assert value(samples, "process_resident_memory_bytes") > 10 * 2**20
    # Nothing watched yet: no pool state is made up.
    assert "gpupool_queue_depth" not in families
    assert "gpupool_pool_workers" not in families
    assert not any(name.startswith("gpupool_gpu_") for name in families)

    with pytest.raises(ValueError, match="not a terminal state"):
        metrics.job_finished("default", JobState.RUNNING)
    with pytest.raises(ValueError, match="not an ErrorCode"):
        metrics.protocol_error("no_such_code")


async def test_queue_depth_and_workers_come_from_redis_at_scrape_time(
    server_metrics: tuple[ServerMetrics, MetricsServer],
    queue: JobQueue,
    redis_server: EmbeddedRedis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    metrics, server = server_metrics
    records: list[dict[str, Any]] = [
        {"health": "healthy", "slots": 4, "running": 1},
        {"health": "healthy", "slots": 2, "running": 2},
        {"health": "draining", "slots": 2, "running": 1},
        {"health": "dead", "slots": 8, "running": 3},
    ]

    async def workers() -> Sequence[Mapping[str, Any]]:
        return records

    metrics.watch(queue, workers)
    for q in ("default", "default", "gpu"):
        await queue.enqueue(JobSpec(argv=("true",), queue=q))
    _, samples = await scrape(server)
    assert value(samples, "gpupool_queue_depth", queue="default") == 2
    assert value(samples, "gpupool_queue_depth", queue="gpu") == 1
    assert value(samples, "gpupool_pool_workers", state="healthy") == 2
    assert value(samples, "gpupool_pool_workers", state="draining") == 1
    assert value(samples, "gpupool_pool_workers", state="dead") == 1
    assert value(samples, "gpupool_pool_slots", state="busy") == 4  # dead workers' slots not counted
    assert value(samples, "gpupool_pool_slots", state="free") == 3  # healthy workers only
    assert value(samples, "gpupool_redis_roundtrip_seconds_count") == 1

    await queue.enqueue(JobSpec(argv=("true",), queue="gpu"))
    _, samples = await scrape(server)
    assert value(samples, "gpupool_queue_depth", queue="gpu") == 2
    assert value(samples, "gpupool_redis_roundtrip_seconds_count") == 2

    # Redis gone: the scrape still answers, with the last known state and the miss counted.
    # (redis-py retries a refused connection for seconds; the refresh gives up sooner here.)
    monkeypatch.setattr(server_module, "REFRESH_TIMEOUT", 0.5)
    redis_server.kill()
    _, samples = await scrape(server)
    assert value(samples, "gpupool_queue_depth", queue="gpu") == 2
    assert value(samples, "gpupool_metrics_refresh_failures_total") == 1


@dataclass(frozen=True)
class MadeUpGpu:
    index: int
    uuid: str


async def test_worker_metrics_without_gpus() -> None:
    metrics = WorkerMetrics(gpus=[])
    server = await serve_metrics(metrics.registry)
    try:
        metrics.set_slots(busy=1, total=2)
        for rtt in (0.003, 0.004, 0.2):
            metrics.heartbeat(rtt)
        metrics.heartbeat_failed()
        metrics.job_started("default")
        metrics.transferred("upload", 1000)
        metrics.transferred("upload", 24)
        with pytest.raises(ValueError, match="direction"):
            metrics.transferred("sideways", 1)
        families, samples = await scrape(server)
    finally:
        await server.close()
    assert value(samples, "gpupool_worker_slots", state="busy") == 1
    assert value(samples, "gpupool_worker_slots", state="free") == 1
    assert value(samples, "gpupool_heartbeat_roundtrip_seconds_count") == 3
    assert value(samples, "gpupool_heartbeat_roundtrip_seconds_bucket", le="0.005") == 2
    assert value(samples, "gpupool_heartbeat_failures_total") == 1
    assert value(samples, "gpupool_jobs_started_total", queue="default") == 1
    assert value(samples, "gpupool_transfer_bytes_total", direction="upload") == 1024
    assert value(samples, "gpupool_transfer_bytes_total", direction="download") == 0
    assert value(samples, "gpupool_worker_gpus_quarantined") == 0
    assert value(samples, "process_resident_memory_bytes") > 0
    assert not any(name.startswith("gpupool_gpu_") for name in families)


async def test_gpus_nvml_cannot_answer_give_no_live_series() -> None:
    """A GPU NVML does not know (no driver here, or an unknown UUID on a GPU machine) yields no
    utilisation, memory or temperature series, and no error; its quarantine flag is bookkeeping
    and still shows."""
    gpu = gpus.GpuInfo(0, "GPU-00000000-0000-0000-0000-000000000000", "made up", 0)
    assert gpus.sample_gpus([gpu]) == []
    metrics = WorkerMetrics(gpus=[gpu], sample_gpus=lambda: gpus.sample_gpus([gpu]))
    metrics.set_quarantined({gpu.uuid})
    server = await serve_metrics(metrics.registry)
    try:
        families, samples = await scrape(server)
    finally:
        await server.close()
    assert value(samples, "gpupool_gpu_quarantined", gpu="0", uuid=gpu.uuid) == 1
    assert value(samples, "gpupool_worker_gpus_quarantined") == 1
    for name in ("utilization_ratio", "memory_used_bytes", "memory_total_bytes", "temperature_celsius"):
        assert f"gpupool_gpu_{name}" not in families


async def test_gpu_health_gauge_says_healthy_or_the_fault_from_a_fixed_set() -> None:
    """Issue 50, metrics cover GPU health: gpupool_gpu_healthy is 1 (reason "none") for a healthy
    GPU and 0 with the fault as its reason for a quarantined one; a GPU whose health is not
    watched has no series; a reason outside the fixed set (a label value of unbounded variety)
    is refused."""
    ok, bad, unwatched = MadeUpGpu(0, "GPU-ok"), MadeUpGpu(1, "GPU-bad"), MadeUpGpu(2, "GPU-other")
    metrics = WorkerMetrics(gpus=[ok, bad, unwatched])
    metrics.set_health({"GPU-ok": "", "GPU-bad": "xid"})
    with pytest.raises(ValueError, match="GPU health reasons"):
        metrics.set_health({"GPU-bad": "Xid 79 at 12:00"})
    server = await serve_metrics(metrics.registry)
    try:
        _, samples = await scrape(server)
    finally:
        await server.close()
    assert value(samples, "gpupool_gpu_healthy", gpu="0", uuid="GPU-ok", reason="none") == 1
    assert value(samples, "gpupool_gpu_healthy", gpu="1", uuid="GPU-bad", reason="xid") == 0
    assert [
        labels for name, labels in samples if name == "gpupool_gpu_healthy" and ("gpu", "2") in labels
    ] == []


async def test_gpu_series_come_from_the_sampler_the_worker_hands_over() -> None:
    """metrics/ reads no driver: what the sampler returns is what is served, a reading it could not
    take (None) is left out, and a GPU it has no sample for has only its quarantine flag."""
    mig, gone = MadeUpGpu(0, "GPU-mig"), MadeUpGpu(1, "GPU-gone")
    calls = 0

    def sample() -> list[GpuSample]:
        nonlocal calls
        calls += 1
        return [GpuSample("GPU-mig", None, 3 * 2**30, 40 * 2**30, 51.0)]

    metrics = WorkerMetrics(gpus=[mig, gone], sample_gpus=sample)
    server = await serve_metrics(metrics.registry)
    try:
        families, samples = await scrape(server)
        await scrape(server)
    finally:
        await server.close()
    assert calls == 2  # asked at every scrape, never cached
    on = {"gpu": "0", "uuid": "GPU-mig"}
    assert value(samples, "gpupool_gpu_memory_used_bytes", **on) == 3 * 2**30
    assert value(samples, "gpupool_gpu_memory_total_bytes", **on) == 40 * 2**30
    assert value(samples, "gpupool_gpu_temperature_celsius", **on) == 51
    assert "gpupool_gpu_utilization_ratio" not in families  # None: not supported in MIG mode
    assert (
        "gpupool_gpu_memory_used_bytes",
        frozenset({"gpu": "1", "uuid": "GPU-gone"}.items()),
    ) not in samples
    assert value(samples, "gpupool_gpu_quarantined", gpu="1", uuid="GPU-gone") == 0
    # No GPU: the sampler is not even asked.
    idle = WorkerMetrics(gpus=[], sample_gpus=sample)
    idle.registry.get_sample_value("gpupool_worker_slots", {"state": "free"})
    assert calls == 2


async def test_gpus_shared_by_gpu_mem_jobs_show_their_jobs_and_declared_memory() -> None:
    """Issue 17 item 4: per GPU, how many pool jobs share it and the memory they declared, from
    the allocator's books as the worker hands them over before a scrape; 0 on a GPU none share."""
    alloc = gpus.GpuAllocator([gpus.GpuInfo(i, f"GPU-{i}", "made up", 80 * 2**30) for i in range(2)], 4)
    metrics = WorkerMetrics(gpus=alloc.gpus)
    alloc.allocate_shared("a#1", "GPU-1", 20 * 2**30)
    alloc.allocate_shared("b#1", "GPU-1", 10 * 2**30)
    metrics.set_shared(alloc.shares())
    server = await serve_metrics(metrics.registry)
    try:
        _, samples = await scrape(server)
        alloc.release("a#1")
        metrics.set_shared(alloc.shares())
        _, after = await scrape(server)
        metrics.set_shared([GpuShare("GPU-0", 1, 5)])  # the whole picture: GPU-1 left out has none
        _, replaced = await scrape(server)
    finally:
        await server.close()
    jobs, declared = "gpupool_gpu_shared_jobs", "gpupool_gpu_shared_memory_declared_bytes"
    assert value(samples, jobs, gpu="1", uuid="GPU-1") == 2
    assert value(samples, declared, gpu="1", uuid="GPU-1") == 30 * 2**30
    assert value(samples, jobs, gpu="0", uuid="GPU-0") == value(samples, declared, gpu="0", uuid="GPU-0") == 0
    assert (value(after, jobs, gpu="1", uuid="GPU-1"), value(after, declared, gpu="1", uuid="GPU-1")) == (
        1,
        10 * 2**30,
    )
    assert value(replaced, jobs, gpu="1", uuid="GPU-1") == 0
    assert value(replaced, declared, gpu="0", uuid="GPU-0") == 5


async def test_real_gpus_have_series() -> None:
    found, nvml = gpus.discover()
    if nvml is None:
        pytest.skip("no NVIDIA driver or GPU on this machine")
    metrics = WorkerMetrics(gpus=found, sample_gpus=lambda: gpus.sample_gpus(found))
    server = await serve_metrics(metrics.registry)
    try:
        _, samples = await scrape(server)
    finally:
        await server.close()
        nvml.close()
    for g in found:
        labels = {"gpu": str(g.index), "uuid": g.uuid}
        assert value(samples, "gpupool_gpu_memory_total_bytes", **labels) == g.memory
        assert 0 <= value(samples, "gpupool_gpu_memory_used_bytes", **labels) <= g.memory
        assert 0 <= value(samples, "gpupool_gpu_utilization_ratio", **labels) <= 1
        assert 0 < value(samples, "gpupool_gpu_temperature_celsius", **labels) < 120
        assert value(samples, "gpupool_gpu_quarantined", **labels) == 0


async def test_http_is_strict_and_survives_hostile_peers() -> None:
    metrics = WorkerMetrics()
    server = await serve_metrics(metrics.registry)
    try:
        assert (server.host, server.port != 0) == ("127.0.0.1", True)  # port 0: the port it took
        assert (await http(server.port, b"GET /nope HTTP/1.1\r\nHost: localhost\r\n\r\n"))[0] == 404
        status, headers, _ = await http(server.port, b"POST /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert (status, headers["allow"]) == (405, "GET, HEAD")
        assert (await http(server.port, b"\x00\xff garbage\r\n\r\n"))[0] == 400
        status, headers, body = await http(server.port, b"HEAD /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert (status, body) == (200, b"")
        assert int(headers["content-length"]) > 0
        status, headers, body = await http(server.port, b"GET /?x=1 HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert (status, headers["connection"], body) == (200, "close", b"gpupool metrics: /metrics\n")
        # An oversized request head (a long header, a long request line, too many headers) is
        # refused with a 4xx before it is buffered whole, and the server keeps serving.
        oversized = [
            b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000,
            b"GET /" + b"a" * 20000,
            b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n" + b"X: 1\r\n" * endpoint.MAX_HEADERS + b"\r\n",
        ]
        for head in oversized:
            assert 400 <= (await http(server.port, head))[0] < 500, head[:40]  # and closed
        await scrape(server)
    finally:
        await server.close()
        await server.close()  # twice is fine


async def test_a_dawdling_peer_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection that does not send a whole request head within REQUEST_TIMEOUT is closed:
    one that sends nothing, and one that sends part of a head and stops."""
    monkeypatch.setattr(endpoint, "REQUEST_TIMEOUT", 0.5)
    server = await serve_metrics(WorkerMetrics().registry)
    try:
        for start in (b"", b"GET /metrics HTTP/1.1\r\nHost: loc"):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(start)
            began = time.monotonic()
            assert await asyncio.wait_for(reader.read(), 5) == b""
            assert 0.4 < time.monotonic() - began < 3
            writer.close()
        await scrape(server)
    finally:
        await server.close()


async def test_close_drops_open_connections() -> None:
    server = await serve_metrics(WorkerMetrics().registry)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /metr")  # and then nothing: a dawdling peer
    await writer.drain()
    await asyncio.sleep(0.05)
    await asyncio.wait_for(server.close(), 5)
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", server.port)


class HangingCollector(Collector):
    """A collector whose collect() blocks, as an NVML query on a failing GPU does, until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def collect(self) -> Iterator[Metric]:
        self.calls += 1
        self.entered.set()
        self.release.wait(60)
        yield GaugeMetricFamily("hanging", "a collector that hung", value=1)


async def test_a_hung_collection_holds_one_thread_and_never_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(endpoint, "COLLECT_TIMEOUT", 1.0)
    hang, registry, before = HangingCollector(), CollectorRegistry(), []

    async def before_scrape() -> None:
        before.append(hang.calls)

    registry.register(hang)
    server = await serve_metrics(registry, before_scrape=before_scrape)
    try:
        first = asyncio.create_task(http(server.port, GET_METRICS))
        assert await asyncio.to_thread(hang.entered.wait, 5)
        # The event loop answers meanwhile, at once: it never waits for the collection.
        began = time.monotonic()
        assert (await http(server.port, b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"))[0] == 200
        assert time.monotonic() - began < 0.5
        # A second scrape waits for the hung one rather than take a second thread; both give up
        # after COLLECT_TIMEOUT with a 503, and the second never got as far as its own collection.
        second = asyncio.create_task(http(server.port, GET_METRICS))
        assert [status for status, _, _ in await asyncio.gather(first, second)] == [503, 503]
        assert (hang.calls, before) == (1, [0])
        # A third waits for that same thread, which ends when NVML answers; then it collects.
        third = asyncio.create_task(http(server.port, GET_METRICS))
        await asyncio.sleep(0.2)
        assert hang.calls == 1
        hang.release.set()
        status, _, body = await third
        assert (status, hang.calls, before) == (200, 2, [0, 1])
        assert b"hanging 1.0" in body
    finally:
        hang.release.set()
        await server.close()


async def test_close_returns_while_a_collection_hangs() -> None:
    hang, registry = HangingCollector(), CollectorRegistry()
    registry.register(hang)
    server = await serve_metrics(registry)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(GET_METRICS)
        await writer.drain()
        assert await asyncio.to_thread(hang.entered.wait, 5)
        began = time.monotonic()
        await asyncio.wait_for(server.close(), endpoint.CLOSE_TIMEOUT + 2)
        assert time.monotonic() - began < endpoint.CLOSE_TIMEOUT
        await asyncio.wait_for(reader.read(), 5)  # the connection is closed, answered or not
        writer.close()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", server.port)
        await server.close()
    finally:
        hang.release.set()


async def test_a_taken_port_names_the_option(tmp_path: Path) -> None:
    empty = tmp_path / "pool.toml"
    empty.write_text("")
    taken = await serve_metrics(WorkerMetrics().registry)
    try:
        given = config.load(env={"GPUPOOL_METRICS_LISTEN": f"127.0.0.1:{taken.port}"}, config_file=empty)

        async def nothing() -> None:
            pass

        with pytest.raises(GpupoolError, match="set metrics_listen to a free HOST:PORT"):
            await serve_for(WorkerMetrics().registry, given, worker=True, before_scrape=nothing)
        await scrape(taken)
    finally:
        await taken.close()


def test_registries_are_separate() -> None:
    first, second = ServerMetrics(), ServerMetrics()
    first.job_enqueued("default")
    assert second.registry.get_sample_value("gpupool_jobs_enqueued_total", {"queue": "default"}) is None
    assert first.registry.get_sample_value("gpupool_jobs_enqueued_total", {"queue": "default"}) == 1


def test_queue_labels_are_bounded() -> None:
    metrics = ServerMetrics()
    for i in range(common.MAX_QUEUES + 5):
        metrics.job_enqueued(f"q{i}")
    get = metrics.registry.get_sample_value
    assert get("gpupool_jobs_enqueued_total", {"queue": "q0"}) == 1
    assert get("gpupool_jobs_enqueued_total", {"queue": f"q{common.MAX_QUEUES}"}) is None
    assert get("gpupool_jobs_enqueued_total", {"queue": common.OTHER_QUEUE}) == 5


def test_metrics_address(tmp_path: Path) -> None:
    empty = tmp_path / "pool.toml"  # not /etc/gpupool/pool.toml, should this machine have one
    empty.write_text("")
    defaults = config.load(env={}, config_file=empty)
    assert metrics_address(defaults, worker=False) == ("127.0.0.1", 9420)
    assert metrics_address(defaults, worker=True) == ("127.0.0.1", 9421)
    given = config.load(env={"GPUPOOL_METRICS_LISTEN": "[::1]:9500"}, config_file=empty)
    assert metrics_address(given, worker=True) == ("::1", 9500)
