"""A live server's metrics endpoint, scraped over HTTP and parsed with prometheus_client's parser
while jobs move through the queue."""

from __future__ import annotations

import asyncio
import time

from prometheus_client.parser import text_string_to_metric_families

from daemon.job import JobState, Outcome
from protocol import Enqueue, Enqueued
from tests.support.pool import Pool


async def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    raw = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


async def scrape_until(port: int, key: tuple[str, tuple[tuple[str, str], ...]], value: float) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + 10
    while True:
        samples = await scrape(port)
        if samples.get(key) == value or time.monotonic() > deadline:
            return samples
        await asyncio.sleep(0.05)


async def test_queue_depth_counters_and_histograms_follow_the_jobs(pool: Pool) -> None:
    assert pool.server.metrics_server is not None
    port = pool.server.metrics_server.port
    q = (("queue", "default"),)
    async with pool.client() as c:
        for i in range(3):
            await c.call(Enqueue({"argv": ["echo", str(i)]}, None), Enqueued)
    samples = await scrape(port)
    assert samples[("gpupool_queue_depth", q)] == 3
    assert samples[("gpupool_jobs_enqueued_total", q)] == 3
    assert samples[("gpupool_protocol_connections", ())] == 0

    for state in (JobState.SUCCEEDED, JobState.FAILED):
        lease = await pool.queue.claim("stand-in", ["default"])
        assert lease is not None
        await pool.queue.complete(lease, Outcome(state, exit_code=0 if state is JobState.SUCCEEDED else 1))
    done = (("queue", "default"), ("state", "failed"))
    samples = await scrape_until(port, ("gpupool_jobs_finished_total", done), 1)
    assert samples[("gpupool_jobs_finished_total", done)] == 1
    assert samples[("gpupool_jobs_finished_total", (("queue", "default"), ("state", "succeeded")))] == 1
    assert samples[("gpupool_job_run_seconds_count", q)] == 2
    assert samples[("gpupool_job_wait_seconds_count", q)] == 2
    assert samples[("gpupool_queue_depth", q)] == 1  # and down it goes
    assert samples[("process_resident_memory_bytes", ())] > 0
