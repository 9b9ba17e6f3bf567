"""Issue 50, GPU health: a GPU with a health fault is quarantined, the job on it told and handed
back (or let finish), no new job lands on it, and it comes back once its check passes.

The faults are real as far as the worker can tell: a real `poold --worker` process reads its GPUs
through the made-up NVML (tests/support/nvml_seam), into whose GPUs the test writes each fault at
run time (FAKE_NVML_FAULTS): an Xid event delivered by NVML's event set, uncorrectable ECC errors,
rows pending remapping, a GPU fallen off the bus, hardware thermal and power-brake slowdown.
The book that decides when a GPU comes back (health_watch.HealthBook) is also driven directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon.job import JobInfo, JobSpec, JobState
from daemon.queue import registry
from daemon.queue.claims import Capacity
from daemon.queue.connection import AnyRedis
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.server.pending import PendingReasons
from daemon.server.web.render import environment
from daemon.worker.gpu_health import Fault, xid_fault
from daemon.worker.gpus import GpuAllocator, NotEnoughGpus
from daemon.worker.health_watch import HealthBook
from daemon.worker.nvml_asks import HUNG_SECONDS, NVML_READ_SECONDS
from daemon.worker.slot_limits import v1_dirs
from tests.support.paths import ROOT
from tests.support.processes import terminate
from tests.support.workers import fake_gpus, running_worker, sh, wait_state, wait_until

NVML_SEAM = ROOT / "tests" / "support" / "nvml_seam"
CLEAR = 0.6  # gpu_health_clear: seconds without a fault before a GPU's check
JOB = 'echo "gpu=$CUDA_VISIBLE_DEVICES"; exec sleep 60'
# Each fault as the made-up NVML is told it (tests/support/nvml_seam/pynvml.py), and its code.
FAULTS: list[tuple[str, dict[str, Any]]] = [
    ("xid", {"xid": [79]}),
    ("ecc", {"ecc": 2}),
    ("pages", {"remap_pending": True}),
    ("lost", {"lost": True}),
    ("thermal", {"clocks": 0x40 | 0x8}),  # HW thermal slowdown (and HW slowdown with it)
    ("power", {"clocks": 0x80 | 0x8}),  # HW power brake slowdown
]


def test_gpu_health_book_takes_a_gpu_out_at_once_and_back_only_after_the_clear_time() -> None:
    """Issue 50, a GPU comes back only after a check passes: the first fault takes it out; a
    fault seen again (or a new Xid) restarts its clear time; its reason is the most lasting
    fault seen (thermal then ECC shows ECC, which does not clear when the GPU cools); its probe
    puts it back only once `clear` seconds passed without a fault. An application's Xid is no fault at all."""
    book = HealthBook(clear=10)
    xid = Fault("xid", "Xid 79")
    assert book.seen("GPU-a", xid, now=100) is True
    assert book.seen("GPU-a", Fault("ecc", "2 errors"), now=105) is False  # out already: no new act
    assert book.fault("GPU-a") == Fault("ecc", "2 errors")  # the most lasting fault seen is its reason
    assert book.due(now=114) == []
    assert book.passed("GPU-a", now=114) is False  # a probe too soon does not put it back
    assert book.due(now=115) == ["GPU-a"]
    book.seen("GPU-a", xid, now=116)  # a new Xid before the probe came back
    assert book.passed("GPU-a", now=116) is False
    assert book.passed("GPU-a", now=126) is True
    assert book.fault("GPU-a") is None
    assert book.due(now=200) == []
    book.seen("GPU-b", Fault("thermal", "hot"), now=100)
    book.seen("GPU-b", Fault("ecc", "3 errors"), now=101)
    book.seen("GPU-b", Fault("thermal", "hot again"), now=102)
    assert book.fault("GPU-b") == Fault("ecc", "3 errors")
    assert xid_fault(13) is None  # an application's (a graphics engine exception)
    assert xid_fault(79) == Fault("xid", "Xid 79 (GPU has fallen off the bus)")


async def test_gpu_health_an_unhealthy_gpu_is_handed_out_and_counted_nowhere(redis: AnyRedis) -> None:
    """Issue 50, the scheduler must not count a quarantined GPU: the allocator hands it to no job,
    whole or shared, and leaves it out of the GPUs a claim weighs (`usable`), so a job needing all
    of the worker's GPUs is parked (left for a worker that has them) rather than waited for here;
    the registration says why; `poolctl show` counts the workers' healthy GPUs alone."""
    gpus = fake_gpus(2)
    alloc = GpuAllocator(gpus, slots=2)
    alloc.mark_unhealthy(gpus[1].uuid, "Xid 79 (GPU has fallen off the bus)")
    assert [g.index for g in alloc.free()] == [0]
    assert alloc.usable() == 1
    assert [room.index for room in alloc.shared_table()] == [0]
    with pytest.raises(NotEnoughGpus):
        alloc.allocate_shared("a", gpus[1].uuid, 2**30)
    assert [g["quarantined"] for g in alloc.describe()] == ["", "Xid 79 (GPU has fallen off the bus)"]
    alloc.mark_healthy(gpus[1].uuid)
    assert (alloc.usable(), alloc.free_count()) == (2, 2)

    queue = JobQueue(redis, lease_seconds=30)
    both, one = await queue.enqueue_many([JobSpec(argv=("true",), gpus=2), JobSpec(argv=("true",), gpus=1)])

    async def workers() -> list[dict[str, Any]]:
        gpu = {"memory": 16 * 2**30}
        return [{"health": "healthy", "queues": ["default"], "gpus": [gpu, gpu | {"health": "xid"}]}]

    reasons = await PendingReasons(queue, workers).of([both])
    assert reasons[both].startswith("needs 2 GPUs, and no live worker has that many"), reasons
    got = await queue.claim_many("w1", ["default"], 2, Capacity(1, gpus_total=1))
    assert [lease.job_id for lease in got] == [one]  # the 2-GPU job blocks nothing here


def test_gpu_health_the_dashboard_says_which_fault_took_a_gpu_out() -> None:
    """Issue 50, the dashboard's worker page shows why: a GPU out for its health says the fault's
    code, since when, and the worker's sentence; a GPU left dirty says it is quarantined."""
    gpu = {"index": 0, "name": "H100", "mem_total": 80 * 2**30, "util_bar": 0, "mem_bar": 0}
    bad = gpu | {"health": "xid", "health_since": 1.8e9, "quarantined": "Xid 79 (GPU has fallen off the bus)"}
    dirty = gpu | {"index": 1, "health": "", "quarantined": "after job default.x: processes [7] hold memory"}
    html = environment().get_template("_gpus.html").render(gpus=[bad, dirty])
    assert "unhealthy (xid, since " in html
    assert "Xid 79 (GPU has fallen off the bus)" in html
    assert "quarantined: after job default.x" in html


@contextlib.contextmanager
def health_worker(
    redis_server: EmbeddedRedis, s3_env: dict[str, str], faults: Path, host: str, *options: str
) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """A `poold --worker` with two made-up GPUs of 16 GiB and two slots, whose GPUs' faults are
    what `faults` says; yields its log's path and its process. Its data is in /tmp, passable by
    the slot uids."""
    data_dir = Path(tempfile.mkdtemp(prefix="gpupool-health-"))
    data_dir.chmod(0o711)
    argv = [
        sys.executable, "-m", "daemon.main", "--worker", "--worker-mode", "multinode",
        "--redis-port", str(redis_server.port), "--metrics-listen", "127.0.0.1:0",
        "--data-dir", str(data_dir), "--heartbeat-interval", "0.1", "--kill-grace", "1",
        "--drain-timeout", "0", "--worker-remote-processors", "2", "--queues", host,
        "--gpu-health-clear", str(CLEAR), *options,
    ]  # fmt: skip
    env = dict(
        os.environ,
        GPUPOOL_MAIN_SERVER_REDIS_PASSWORD=redis_server.password,
        PYTHONPATH=os.pathsep.join([str(NVML_SEAM), str(ROOT)]),
        FAKE_NVML_GPUS="16,16",
        FAKE_NVML_HOST=host,
        FAKE_NVML_FAULTS=str(faults),
        **s3_env,
    )
    log_path = data_dir.parent / f"{data_dir.name}.log"
    with open(log_path, "wb") as log, subprocess.Popen(argv, env=env, stderr=log) as proc:
        try:
            yield log_path, proc
        finally:
            terminate(proc, 30)


def inject(path: Path, faults: dict[int, dict[str, Any]]) -> None:
    """Write the GPUs' faults whole, by index (renamed into place: the seam never reads half)."""
    part = path.with_suffix(".part")
    part.write_text(json.dumps({str(i): f for i, f in faults.items()}))
    part.replace(path)


async def log_lines(queue: JobQueue, job_id: str) -> list[str]:
    return b"".join(d for _, d in await queue.read_log(job_id)).decode().splitlines()


async def gpu_of(queue: JobQueue, job_id: str, host: str, count: int = 1) -> int:
    """The index of the GPU the job's `count`-th attempt was given (its log's gpu= line)."""
    said: list[str] = []

    async def started() -> bool:
        said[:] = [line for line in await log_lines(queue, job_id) if line.startswith("gpu=")]
        return len(said) >= count

    await wait_until(started, 30, f"attempt {count} of {job_id} to start")
    return int(said[count - 1].removeprefix(f"gpu=GPU-fake-{host}-"))


async def gpus_registered(queue: JobQueue, host: str) -> list[dict[str, Any]]:
    """The GPUs the registration of the worker serving queue `host` lists."""
    (worker,) = [w for w in await registry.list_workers(queue.redis) if w.get("queues") == [host]]
    gpus: list[dict[str, Any]] = worker["gpus"]
    return gpus


async def gpu_registered(queue: JobQueue, host: str, index: int) -> dict[str, Any]:
    return next(g for g in await gpus_registered(queue, host) if g["index"] == index)


async def wait_health(
    queue: JobQueue, host: str, index: int, code: str, what: str, *, timeout: float = 30
) -> dict[str, Any]:
    """Wait until the registration says GPU `index`'s health is `code` ("": healthy)."""
    seen: dict[str, Any] = {}

    async def says() -> bool:
        seen.update(await gpu_registered(queue, host, index))
        return bool(seen.get("health") == code)

    await wait_until(says, timeout, what)
    return seen


async def scrape_worker(log: Path) -> dict[tuple[str, str], tuple[str, float]]:
    """The worker's /metrics (its port from its log), within a bound: each GPU series' (name, gpu
    index) with its `reason` label ("" for none) and value. Fails unless the scrape answers 200."""
    port = re.search(rb"metrics on http://127\.0\.0\.1:(\d+)/metrics", log.read_bytes())
    assert port is not None, "the worker does not say where its metrics are"
    async with asyncio.timeout(30):
        reader, writer = await asyncio.open_connection("127.0.0.1", int(port.group(1)))
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = await reader.read()
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return {
        (s.name, s.labels["gpu"]): (s.labels.get("reason", ""), s.value)
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
        if "gpu" in s.labels
    }


async def each_fault_requeued(queue: JobQueue, host: str, faults: Path) -> None:
    """Each fault in turn on the worker serving `host` (gpu_health_policy requeue)."""
    spec = JobSpec(argv=("sh", "-c", JOB), gpus=1, queue=host)
    for code, fault in FAULTS:
        first, _ = await queue.enqueue(spec)
        bad = await gpu_of(queue, first, host)
        inject(faults, {bad: fault})
        said = await wait_health(queue, host, bad, code, f"GPU {bad} quarantined for {code}")
        assert said["quarantined"], said  # why, in words, for `poolctl workers` and the dashboard
        # handed back, and run again on the other GPU
        assert await gpu_of(queue, first, host, count=2) == 1 - bad, code
        told = [line for line in await log_lines(queue, first) if line.startswith("[gpupool]")]
        assert any(f"GPU {bad} (GPU-fake-{host}-{bad}) is unhealthy" in line for line in told), told
        assert (await queue.get(first)).attempt == 2, code

        if code == "xid":  # a fresh Xid keeps it out while the next job is looked at
            inject(faults, {bad: {"xid": [79, 48]}})
        second, _ = await queue.enqueue(spec)
        await asyncio.sleep(0.2)  # its claim comes at once (the enqueue wakes the worker)
        assert (await queue.get(second)).state is JobState.QUEUED, f"{code}: landed on the bad GPU"
        inject(faults, {})
        assert await gpu_of(queue, second, host) == bad, code  # back in use once checked
        back = await wait_health(queue, host, bad, "", f"GPU {bad} back after {code}")
        assert back["quarantined"] == "", back
        for job in (first, second):
            await queue.cancel(job)
        for job in (first, second):
            await wait_state(queue, job, JobState.CANCELLED)


async def xid_let_finish(queue: JobQueue, host: str, faults: Path) -> None:
    """An Xid under a job on the worker serving `host` (gpu_health_policy let_finish)."""
    job, _ = await queue.enqueue(JobSpec(argv=("sh", "-c", JOB), gpus=1, queue=host))
    bad = await gpu_of(queue, job, host)
    inject(faults, {bad: {"xid": [79]}})
    await wait_health(queue, host, bad, "xid", f"GPU {bad} quarantined")

    async def told() -> bool:
        return any("runs on to its end" in line for line in await log_lines(queue, job))

    await wait_until(told, 10, "the job to be told")
    info = await queue.get(job)
    assert (info.state, info.attempt) == (JobState.RUNNING, 1)
    await queue.cancel(job)
    await wait_state(queue, job, JobState.CANCELLED)
    assert (await wait_health(queue, host, bad, "", f"GPU {bad} back"))["quarantined"] == ""


async def test_gpu_health_each_fault_quarantines_hands_back_or_lets_finish_and_clears(
    redis_server: EmbeddedRedis, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 50, GPU health done-when, on two workers of two GPUs each (side by side, each
    serving a queue of its own). With gpu_health_policy requeue (the default), for each fault in
    turn: the GPU a job runs on is quarantined (its registration says which fault and why); the
    job is told in its log and handed back, and runs again on the other GPU; no new job lands on
    the quarantined GPU, though a slot is free for it; once the fault is gone for
    gpu_health_clear seconds and the check passes, the GPU is back and the waiting job starts on
    it. With let_finish: an Xid quarantines the GPU and the job is told, but runs on (its first
    attempt); the GPU comes back after its check."""
    queue = JobQueue(redis_server.client(), lease_seconds=30)
    hosts = {policy: secrets.token_hex(3) for policy in ("requeue", "let_finish")}
    faults = {policy: tmp_path / f"faults-{policy}.json" for policy in hosts}
    logs: list[Path] = []
    with contextlib.ExitStack() as workers:
        try:
            for policy, host in hosts.items():
                options = ("--gpu-health-policy", policy)
                log, _ = workers.enter_context(
                    health_worker(redis_server, s3_env, faults[policy], host, *options)
                )
                logs.append(log)

            async def registered() -> bool:
                return len(await registry.list_workers(queue.redis)) == len(hosts)

            await wait_until(registered, 30, "the workers to register")
            await asyncio.gather(
                each_fault_requeued(queue, hosts["requeue"], faults["requeue"]),
                xid_let_finish(queue, hosts["let_finish"], faults["let_finish"]),
            )
        except BaseException:
            for log in logs:
                print(log.read_text()[-6000:])
            raise
        finally:
            await queue.redis.aclose()


async def test_gpu_health_a_claim_never_asks_nvml_of_a_gpu_out_for_its_health(
    queue: JobQueue, tmp_path: Path
) -> None:
    """issue 50, a review's finding: every claim read NVML's free memory of every GPU, the ones out
    for their health among them, on the event loop's default executor: NVML hung on a GPU fallen
    off the bus held every claim (no job started, even on the sound GPUs) and the worker's exit.
    Only the GPUs in use are read, in a daemon thread, within a bound."""
    gpus = fake_gpus(2)
    asked: list[list[str]] = []
    release = threading.Event()

    class HangsOnTheLostGpu:
        def free_memory(self, uuids: Iterable[str]) -> dict[str, int]:
            asked.append(list(uuids))
            if gpus[1].uuid in asked[-1]:
                release.wait(20)  # NVML hung on the GPU that fell off the bus
            return dict.fromkeys(asked[-1], 16 * 2**30)

        def close(self) -> None:
            pass

    try:
        async with running_worker(queue, tmp_path / "w", gpus=gpus, slots=2, heartbeat_seconds=0.1) as worker:
            worker.gpu_books._nvml = HangsOnTheLostGpu()  # type: ignore[assignment]
            worker.gpu_books.allocator.mark_unhealthy(
                gpus[1].uuid, "NVML says the GPU has fallen off the bus"
            )
            job_id, _ = await queue.enqueue(sh("true", gpus=1))
            await wait_state(queue, job_id, JobState.SUCCEEDED, timeout=10)
        assert asked
        assert all(gpus[1].uuid not in uuids for uuids in asked), asked
    finally:
        release.set()


async def test_gpu_health_a_gpu_whose_nvml_hangs_is_quarantined_and_the_others_still_checked(
    redis_server: EmbeddedRedis, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 50, a review's finding: the health watch read every GPU's health in one pass, so one
    NVML call that hung (a GPU whose driver stops answering, as one falling off the bus does)
    stopped every health check of the worker for good. Each GPU's read is bounded: the GPU whose
    NVML does not answer for HUNG_SECONDS is quarantined for it (`hung`) and its job told and
    handed back, to run on the other GPU; the other GPU's faults are still seen, and its readings
    still come; the worker's /metrics still answers, saying why the GPU is out (a second review
    found each scrape read every GPU through NVML and answered 503 while one hung, so the alert
    on gpupool_gpu_healthy could never fire); the hung GPU comes back once NVML answers for
    `gpu_health_clear` seconds and its probe passes; and a worker stopped while a GPU's NVML
    hangs under its job (the job's end checks the GPU) still stops, handing its job back."""
    queue = JobQueue(redis_server.client(), lease_seconds=30)
    host = secrets.token_hex(3)
    faults = tmp_path / "faults.json"
    spec = JobSpec(argv=("sh", "-c", JOB), gpus=1, queue=host)
    with health_worker(redis_server, s3_env, faults, host) as (log, proc):
        try:
            first, _ = await queue.enqueue(spec)
            bad = await gpu_of(queue, first, host)
            inject(faults, {bad: {"hang": True}})
            what = f"GPU {bad} quarantined for not answering"
            said = await wait_health(queue, host, bad, "hung", what, timeout=HUNG_SECONDS + 30)
            assert said["quarantined"].startswith("NVML does not answer"), said
            assert await gpu_of(queue, first, host, count=2) == 1 - bad  # handed back, run on the other
            told = [line for line in await log_lines(queue, first) if line.startswith("[gpupool]")]
            what = f"GPU {bad} (GPU-fake-{host}-{bad}) is unhealthy: NVML does not answer"
            assert any(what in line for line in told), told

            read = (await gpu_registered(queue, host, 1 - bad))["read_at"]

            async def read_again() -> bool:  # the other GPU's readings go on while this one hangs
                return bool((await gpu_registered(queue, host, 1 - bad))["read_at"] > read)

            await wait_until(read_again, 10, f"GPU {1 - bad} read again while GPU {bad} hangs")
            series = await scrape_worker(log)
            assert series[("gpupool_gpu_healthy", str(bad))] == ("hung", 0), series
            assert series[("gpupool_gpu_healthy", str(1 - bad))] == ("none", 1), series
            assert ("gpupool_gpu_memory_total_bytes", str(1 - bad)) in series, series
            await queue.cancel(first)
            await wait_state(queue, first, JobState.CANCELLED)

            inject(faults, {bad: {"hang": True}, 1 - bad: {"ecc": 2}})  # still checked, beside the hung one
            await wait_health(queue, host, 1 - bad, "ecc", f"GPU {1 - bad} quarantined beside the hung one")
            inject(faults, {})
            for index in (bad, 1 - bad):
                back = await wait_health(queue, host, index, "", f"GPU {index} back")
                assert back["quarantined"] == "", back  # nor left counted as dirty

            second, _ = await queue.enqueue(spec)
            hung = await gpu_of(queue, second, host)
            inject(faults, {hung: {"hang": True}})
            await asyncio.sleep(NVML_READ_SECONDS)  # a health read of its GPU is hanging
            proc.terminate()  # while NVML hangs on the GPU the job's end then checks
            await asyncio.to_thread(proc.wait, 60)
            assert (await queue.get(second)).state is JobState.QUEUED  # handed back at the stop
        except BaseException:
            print(log.read_text()[-8000:])
            raise
        finally:
            inject(faults, {})
            await queue.redis.aclose()


async def test_gpu_health_a_read_that_answers_within_the_hung_bound_faults_nothing(
    redis_server: EmbeddedRedis, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 50, a review's finding: one health read slower than NVML_READ_SECONDS made the GPU
    `hung` at once and, with gpu_health_policy requeue, handed its job back and kept the GPU out
    for gpu_health_clear: a driver lock held a few seconds (a big CUDA context's teardown,
    `nvidia-smi -q`) would hand back every job of the worker. A read is `hung` only once it has
    gone unanswered for HUNG_SECONDS; one that answers before is no fault, and the job runs on."""
    queue = JobQueue(redis_server.client(), lease_seconds=30)
    host = secrets.token_hex(3)
    faults = tmp_path / "faults.json"
    with health_worker(redis_server, s3_env, faults, host) as (log, _):
        try:
            job, _ = await queue.enqueue(JobSpec(argv=("sh", "-c", JOB), gpus=1, queue=host))
            slow = await gpu_of(queue, job, host)
            inject(faults, {slow: {"hang": True}})
            await asyncio.sleep(2 * NVML_READ_SECONDS)  # well past one pass's wait, short of HUNG_SECONDS
            inject(faults, {})
            read = (await gpu_registered(queue, host, slow)).get("read_at", 0)

            async def answered() -> bool:  # its readings come again: NVML answered for it
                return bool((await gpu_registered(queue, host, slow)).get("read_at", 0) > read)

            await wait_until(answered, 10, f"GPU {slow} read again")
            gpu = await gpu_registered(queue, host, slow)
            assert (gpu["health"], gpu["quarantined"]) == ("", ""), gpu
            info = await queue.get(job)
            assert (info.state, info.attempt) == (JobState.RUNNING, 1)
            assert not [line for line in await log_lines(queue, job) if line.startswith("[gpupool]")]
            await queue.cancel(job)
            await wait_state(queue, job, JobState.CANCELLED)
        except BaseException:
            print(log.read_text()[-8000:])
            raise
        finally:
            inject(faults, {})
            await queue.redis.aclose()


async def test_gpu_health_a_worker_whose_nvml_hangs_at_its_start_or_its_stop_still_stops(
    redis_server: EmbeddedRedis, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 50, a review's finding: the worker found its GPUs at its start, and closed NVML at
    its stop, on the event loop's default executor without a bound, and the exit waits for that
    executor's threads: a worker whose NVML hung there never exited. Both run in a daemon thread
    of their own within a bound: a worker stopped while NVML hangs at its close, or while its
    discovery hangs, still exits."""
    faults = tmp_path / "faults.json"
    host = secrets.token_hex(3)
    queue = JobQueue(redis_server.client(), lease_seconds=30)
    try:
        with health_worker(redis_server, s3_env, faults, host) as (log, proc):
            try:

                async def registered() -> bool:
                    return bool(await registry.list_workers(queue.redis))

                await wait_until(registered, 30, "the worker to register")
                inject(faults, {1: {"hang": True}})  # NVML's close then hangs too
                proc.terminate()
                await asyncio.to_thread(proc.wait, 60)
            except BaseException:
                print(log.read_text()[-8000:])
                raise
        with health_worker(redis_server, s3_env, faults, host) as (log, proc):
            try:
                await asyncio.sleep(3)  # started, and hung in listing its GPUs
                assert not await registry.list_workers(queue.redis)  # it did not get past them
                proc.terminate()
                await asyncio.to_thread(proc.wait, 60)
            except BaseException:
                print(log.read_text()[-8000:])
                raise
    finally:
        inject(faults, {})
        await queue.redis.aclose()


def test_xid_watch_logs_a_failing_wait_once_and_tries_less_often(tmp_path: Path) -> None:
    """Issue 50, GPU health (the Xid watch): a GPU that falls off the bus under the watch fails
    every wait for an Xid; the watch logs that once, not twice a second for ever, pauses longer
    and longer between tries, and still ends when stopped."""
    faults = tmp_path / "faults.json"
    script = f"""
import json, logging, sys, time
from daemon.worker import gpu_health
import pynvml
logged = []
gpu_health.log.addHandler(logging.Handler())
gpu_health.log.handlers[-1].emit = logged.append
pynvml.nvmlInit()
uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
watch = gpu_health.XidWatch([uuid], lambda u, x: None)
watch.start()
time.sleep(0.3)
open({str(faults)!r}, "w").write(json.dumps({{"0": {{"lost": True}}}}))
time.sleep(2.0)
watch.stop()
print(json.dumps({{"ended": watch.join(2.0), "logged": [r.getMessage() for r in logged]}}))
"""
    seen, _ = on_made_up_nvml(script, faults, gpus="80")
    assert seen["ended"] is True
    assert len(seen["logged"]) == 1, seen["logged"]
    assert "GPU is lost" in seen["logged"][0]


@contextlib.contextmanager
def breaking(fault: str, then: str, before: str = "") -> Iterator[tuple[Path, Path]]:
    """A job's script that runs `before`, then gives its first GPU `fault` (the JSON of its entry
    in the made-up NVML's faults file: '"ecc": 2') and then dies of it at once with `then`
    (heartbeats, and so the health watch's passes, come once a second: the end comes first);
    yields the script and the faults file, in a directory the job, as a slot uid, may write."""
    shared = Path(tempfile.mkdtemp(prefix="gpupool-faults-"))
    shared.chmod(0o1777)
    faults = shared / "faults.json"
    script = shared / "break.sh"
    script.write_text(
        "i=${CUDA_VISIBLE_DEVICES%%,*}; i=${i##*-}\n"
        f"{before}\n"
        f'printf \'{{"%s": {{{fault}}}}}\' "$i" > {shared}/part && mv {shared}/part {faults}\n'
        f"{then}\n"
    )
    script.chmod(0o755)
    try:
        yield script, faults
    finally:
        shutil.rmtree(shared, ignore_errors=True)


CUDA_ECC_EXIT = 'echo "CUDA error: uncorrectable ECC error encountered"; exit 1'
ECC_FAULT = "is unhealthy: 2 uncorrectable ECC error(s) since the driver loaded"


async def first_end(queue: JobQueue, job: str) -> JobInfo:
    """The job once its first attempt has ended."""

    async def ended() -> bool:
        attempts = (await queue.get(job)).attempts
        return bool(attempts) and attempts[0].how != "running"

    await wait_until(ended, 30, "the job's first attempt to end")
    return await queue.get(job)


@pytest.mark.parametrize("policy", ["requeue", "let_finish"])
async def test_gpu_health_a_job_killed_by_its_gpus_fault_before_the_watch_saw_it_is_its_gpus(
    redis_server: EmbeddedRedis, s3_env: dict[str, str], policy: str
) -> None:
    """issue 50, a review's finding 3: a GPU that fails under its job (uncorrectable ECC errors
    here, as an Xid 79 would be) most often kills it first: the program gets a CUDA error and
    exits 1 before the health watch's next pass stops it. The job ended FAILED, counted against
    its user and its max_attempts, for its GPU's fault, which nothing said. Checked at its end,
    the fault is seen (and the GPU quarantined), and gpu_health_policy decides as when the watch
    sees it first: requeue hands it back (its attempt released, not failed; it needs both GPUs of
    the worker, one of them now out, so it waits, queued, the fault in its detail); let_finish
    lets its end stand, the fault in its detail. Its log says so either way, and once: the
    quarantine the end check made said "the job runs on to its end (let_finish)" too, of the
    job that had just ended (issue 50, review 50c finding 3)."""
    host = secrets.token_hex(3)
    queue = JobQueue(redis_server.client(), lease_seconds=30)
    options = ("--heartbeat-interval", "1", "--gpu-health-policy", policy)
    with (
        breaking('"ecc": 2', CUDA_ECC_EXIT) as (breaks, faults),
        health_worker(redis_server, s3_env, faults, host, *options) as (log, _),
    ):
        try:
            job, _ = await queue.enqueue(JobSpec(argv=("sh", str(breaks)), gpus=2, queue=host))
            info = await first_end(queue, job)
            if policy == "requeue":
                assert (info.state, info.attempts[0].how) == (JobState.QUEUED, "released"), info.detail
            else:
                assert (info.state, info.attempts[0].how) == (JobState.FAILED, "failed"), info.detail
                assert info.detail.startswith("exited with status 1; GPU "), info.detail
            assert ECC_FAULT in info.detail, info.detail
            told = [line for line in await log_lines(queue, job) if line.startswith("[gpupool]")]
            assert [line for line in told if ECC_FAULT in line] == told, told
            assert len(told) == 1, told
            assert "the job ended on it" in told[0], told
            assert (await wait_health(queue, host, 0, "ecc", "GPU 0 quarantined"))["quarantined"]
            if policy == "requeue":
                await queue.cancel(job)
                await wait_state(queue, job, JobState.CANCELLED)
        except BaseException:
            print(log.read_text()[-6000:])
            raise
        finally:
            await queue.redis.aclose()


async def test_gpu_health_a_shell_its_gpus_fault_ended_is_not_requeued(
    redis_server: EmbeddedRedis, s3_env: dict[str, str]
) -> None:
    """issue 50, review 50c finding 1: a `poolctl shell --gpus 2` whose shell dies of its GPU's
    ECC fault (exit 1, before the watch's pass) was handed back by the end check, which set the
    ending itself past JobRun.hand_back: requeued, it started again with nobody attached. A
    shell is never requeued: its end is STOPPED, FAILED saying why, as the watch's own stop of
    a shell is."""
    host = secrets.token_hex(3)
    queue = JobQueue(redis_server.client(), lease_seconds=30)
    options = ("--heartbeat-interval", "1", "--gpu-health-policy", "requeue")
    with (
        breaking('"ecc": 2', CUDA_ECC_EXIT) as (breaks, faults),
        health_worker(redis_server, s3_env, faults, host, *options) as (log, _),
    ):
        try:
            spec = JobSpec(argv=("sh", str(breaks)), gpus=2, queue=host, tty=True, idle_limit=60)
            job, _ = await queue.enqueue(spec)
            info = await first_end(queue, job)
            assert (info.state, info.attempts[0].how) == (JobState.FAILED, "failed"), info.detail
            assert ECC_FAULT in info.detail, info.detail
            assert "a shell is not requeued" in info.detail, info.detail
            assert info.attempt == 1
        except BaseException:
            print(log.read_text()[-6000:])
            raise
        finally:
            await queue.redis.aclose()


@pytest.mark.parametrize("end", ["thermal", "out of memory"])
async def test_gpu_health_a_job_failing_of_its_own_on_a_faulty_gpu_fails(
    redis_server: EmbeddedRedis, s3_env: dict[str, str], end: str
) -> None:
    """issue 50, review 50c finding 4: only a fault that kills programs (lost, ecc, xid, pages)
    makes a failed job's end its GPU's. A thermal slowdown slows a program, no more: a job that
    crashes of its own bug on a hot GPU was handed back as a loss (DEAD at max_attempts) where it
    fails. And a job the kernel's OOM killer ended, on a GPU with an ECC fault, lost its "out of
    memory" detail to a hand-back: it fails saying so."""
    if end == "out of memory" and (os.geteuid() != 0 or v1_dirs() is None):
        pytest.skip("needs root and cgroup v1 memory, cpu and cpuacct (--mem)")
    host = secrets.token_hex(3)
    queue = JobQueue(redis_server.client(), lease_seconds=30)
    options = ("--heartbeat-interval", "1", "--gpu-health-policy", "requeue")
    grow = "head -c 512M /dev/zero | tail"  # tail holds the one line, 512 MiB of it, in memory
    # The fault comes last, a moment before the end: were it seen while the job runs, the watch
    # would hand the job back by its policy, rightly (an OOM takes a while under load).
    fault, before, then, mem = ('"clocks": 72', "", "exit 1", 0)
    if end == "out of memory":
        fault, before, then, mem = ('"ecc": 2', f"{grow}; code=$?", "exit $code", 64 * 2**20)
    with (
        breaking(fault, then, before) as (breaks, faults),
        health_worker(redis_server, s3_env, faults, host, *options) as (log, _),
    ):
        try:
            spec = JobSpec(argv=("sh", str(breaks)), gpus=2, queue=host, mem=mem)
            job, _ = await queue.enqueue(spec)
            info = await first_end(queue, job)
            assert (info.state, info.attempts[0].how) == (JobState.FAILED, "failed"), info.detail
            if end == "thermal":
                assert info.detail == "exited with status 1", info.detail
            else:
                assert info.detail.startswith("out of memory: used "), info.detail
                assert "its --mem of 64 MiB; the kernel killed 1 of its processes" in info.detail, info.detail
            told = [line for line in await log_lines(queue, job) if "the job ended on it" in line]
            assert told == [], told
        except BaseException:
            print(log.read_text()[-6000:])
            raise
        finally:
            await queue.redis.aclose()


def on_made_up_nvml(script: str, faults: Path, gpus: str = "16,16") -> tuple[dict[str, Any], str]:
    """Run `script` (Python printing one JSON line last) in a fresh interpreter on made-up GPUs
    (`gpus`: their GiB, FAKE_NVML_GPUS) whose faults are what `faults` says (none at first); its
    JSON, and the end of what it wrote on stderr."""
    faults.write_text("{}")
    env = {
        **os.environ,
        "PYTHONPATH": f"{NVML_SEAM}{os.pathsep}{ROOT}",
        "FAKE_NVML_GPUS": gpus,
        "FAKE_NVML_FAULTS": str(faults),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr[-2000:]


def test_gpu_health_the_end_check_whose_read_hangs_still_finds_the_fault_booked_meanwhile(
    tmp_path: Path,
) -> None:
    """issue 50, review 50c finding 2: the end check of a job that failed by itself reads its
    GPUs' health within a bound; when the read hangs (NVML of a GPU fallen off the bus: the case
    the bound is for), it said "sound" at the bound, never looking at the book, where the Xid
    watch had quarantined the GPU meanwhile (Xid 79): the job ended FAILED though the worker
    knew. Here GPU 0's NVML hangs (the made-up NVML's "hang"), and the Xid watch, watching GPU 1,
    sees an Xid 79 on it while the end check of a job on both waits: the check finds it."""
    faults = tmp_path / "faults.json"
    script = f"""
import asyncio, json, time
import pynvml
from daemon.worker import gpu_health
from daemon.worker.gpus import GpuAllocator, GpuInfo
from daemon.worker.health_watch import HealthWatch
pynvml.nvmlInit()
uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]
gpus = [GpuInfo(index=i, uuid=u, name="Made-up GPU", memory=16 * 2**30) for i, u in enumerate(uuids)]
watch = HealthWatch(gpus, GpuAllocator(gpus, slots=1), lambda: [], lambda: None, every=1, clear=600)
async def main():
    loop = asyncio.get_running_loop()
    xids = gpu_health.XidWatch(uuids[1:], lambda u, x: loop.call_soon_threadsafe(watch._xid, u, x))
    xids.start()
    open({str(faults)!r}, "w").write(json.dumps({{"0": {{"hang": True}}}}))
    check = asyncio.create_task(watch.fault_under(gpus))
    await asyncio.sleep(0.5)  # the check's read is under way, hung on GPU 0
    booked_before = bool(watch.book.unhealthy)
    open({str(faults)!r}, "w").write(json.dumps({{"0": {{"hang": True}}, "1": {{"xid": [79]}}}}))
    found = await check
    xids.stop()
    return booked_before, found
booked_before, found = asyncio.run(main())
print(json.dumps({{"booked_before": booked_before, "found": found and found.what}}))
"""
    seen, stderr = on_made_up_nvml(script, faults)
    assert seen["booked_before"] is False  # the check began with a sound book: it read, and hung
    assert seen["found"], (seen, stderr)
    assert "Xid 79 (GPU has fallen off the bus)" in seen["found"], seen


def test_gpu_health_the_end_check_reads_the_gpus_not_out_beside_one_out(tmp_path: Path) -> None:
    """issue 50, a final review's finding 1: the end check of a job that failed by itself read
    none of its GPUs once one of them was out already (GPU 0 out for a thermal slowdown, under
    gpu_health_policy let_finish): a job on GPUs 0 and 1 that died of a fresh uncorrectable ECC
    error on GPU 1 ended as a plain failure. The GPUs not out are read; the book judges the rest."""
    faults = tmp_path / "faults.json"
    script = f"""
import asyncio, json
import pynvml
from daemon.worker.gpus import GpuAllocator, GpuInfo
from daemon.worker.health_watch import HealthWatch
pynvml.nvmlInit()
uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]
gpus = [GpuInfo(index=i, uuid=u, name="Made-up GPU", memory=16 * 2**30) for i, u in enumerate(uuids)]
watch = HealthWatch(
    gpus, GpuAllocator(gpus, slots=1), lambda: [], lambda: None, every=1, clear=600, policy="let_finish"
)
async def main():
    open({str(faults)!r}, "w").write(json.dumps({{"0": {{"clocks": 72}}}}))
    watch._apply(*(await watch._pass()), 0.0)  # a pass takes GPU 0 out for its slowdown
    out = sorted(watch.book.unhealthy)
    open({str(faults)!r}, "w").write(json.dumps({{"0": {{"clocks": 72}}, "1": {{"ecc": 2}}}}))
    found = await watch.fault_under(gpus)  # the job on both died of GPU 1's ECC error
    return out, found
out, found = asyncio.run(main())
print(json.dumps({{"out": out, "found": found and found.what, "hand_back": found and found.hand_back}}))
"""
    seen, stderr = on_made_up_nvml(script, faults)
    assert len(seen["out"]) == 1  # GPU 0, out for its slowdown, before the job's end
    assert seen["found"], (seen, stderr)
    assert "GPU 1 (" in seen["found"], seen
    assert ECC_FAULT in seen["found"], seen
    assert seen["hand_back"] is False  # let_finish: the fault named in its detail
