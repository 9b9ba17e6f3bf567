"""Issue 50: what each GPU-hour did. A real worker (in process, real jobs, real Redis) on made-up
GPUs whose readings the test sets through the worker's sampler seam, as NVML's would come:

- a job's GPU usage summary (worker/gpu_usage.py) matches the readings fed to it: mean and p95
  utilisation, peak memory, energy (from power, and from NVML's energy counter), efficiency;
  recorded with its outcome (`gpu_usage`), in the notification's payload and in the metrics;
- idle GPUs (worker/idle_gpus.py): a job that leaves its GPUs idle is flagged after the
  (shortened) time in its log and its record; with its queue's policy, after the grace, it is
  requeued or cancelled; a busy one is never flagged.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import orjson

from daemon import webhook
from daemon.job import JobInfo, JobState
from daemon.metrics.worker import GpuSample
from daemon.queue import accounting
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.worker.gpu_usage import GpuUsage
from daemon.worker.gpus import GpuInfo
from daemon.worker.idle_gpus import IdlePolicy
from tests.support.paths import ROOT
from tests.support.processes import terminate
from tests.support.workers import fake_gpus, running_worker, sh, wait_state, wait_until

GIB = 2**30
NVML_SEAM = ROOT / "tests" / "support" / "nvml_seam"


@contextlib.contextmanager
def gpu_worker(
    redis_server: EmbeddedRedis, s3_env: dict[str, str], env: dict[str, str], *options: str
) -> Iterator[None]:
    """A `poold --worker` with two made-up 16 GiB GPUs, `env` and `options` added; as root, its
    jobs run as uids it leases, so its data is in /tmp (pytest's directories are root's, 0700)."""
    data_dir = Path(tempfile.mkdtemp(prefix="gpupool-usage-"))
    data_dir.chmod(0o711)
    argv = [
        sys.executable, "-m", "daemon.main", "--worker", "--worker-mode", "multinode",
        "--redis-port", str(redis_server.port), "--metrics-listen", "127.0.0.1:0",
        "--data-dir", str(data_dir), "--kill-grace", "1", "--drain-timeout", "0",
        "--worker-remote-processors", "2", *options,
    ]  # fmt: skip
    env = dict(
        os.environ,
        GPUPOOL_MAIN_SERVER_REDIS_PASSWORD=redis_server.password,
        PYTHONPATH=os.pathsep.join([str(NVML_SEAM), str(ROOT)]),
        FAKE_NVML_GPUS="16,16",
        FAKE_NVML_HOST=secrets.token_hex(3),
        **s3_env,
        **env,
    )
    with open(data_dir / "worker.log", "wb") as log, subprocess.Popen(argv, env=env, stderr=log) as proc:
        try:
            yield
        finally:
            terminate(proc, 30)
            shutil.rmtree(data_dir, ignore_errors=True)


def nearest_rank(values: list[float], q: float) -> float:
    """The q-th percentile by nearest rank: the reference the summary's histogram must meet."""
    ordered = sorted(values)
    return ordered[math.ceil(q * len(ordered)) - 1]


def idle_watched_worker(
    queue: JobQueue,
    tmp_path: Path,
    gpus: list[GpuInfo],
    sampler: Callable[[], list[GpuSample]],
    policy: IdlePolicy,
    *,
    queues: list[str],
    slots: int,
) -> AbstractAsyncContextManager[Any]:
    """A worker of `slots` on `queues` whose `gpus` read as `sampler` says, every 50 ms, and whose
    idle-GPU policy is `policy`."""
    return running_worker(
        queue,
        tmp_path / "w",
        gpus=gpus,
        slots=slots,
        queues=queues,
        gpu_sampler=sampler,
        heartbeat_seconds=0.05,
        idle_gpus=policy,
    )


async def test_a_jobs_gpu_usage_summarises_the_readings_fed_to_it(queue: JobQueue, tmp_path: Path) -> None:
    """Issue 50, per-job GPU usage: the summary recorded with a job's end is the mean, p95, peak
    and energy of exactly the readings its two GPUs gave while it ran, per GPU and whole, and its
    efficiency is the mean of its GPUs' mean utilisation; the same summary reaches the job's
    notification payload and the per-queue efficiency histogram."""
    gpus = fake_gpus(2)
    started, go = tmp_path / "started", tmp_path / "go"
    util0 = [i * 5 / 100 for i in range(20)]  # GPU 0: 0 % to 95 %
    mem0 = [(1 + (i * 7) % 10) * GIB for i in range(20)]  # peak 10 GiB, not at the end
    fed, lock, times = 0, threading.Lock(), []

    def sampler() -> list[GpuSample]:
        """Nothing until the job runs; then 20 readings; then nothing, and the job may end."""
        nonlocal fed
        with lock:
            if not started.exists() or fed >= len(util0):
                if fed >= len(util0):
                    go.touch()
                return []
            i, fed = fed, fed + 1
        times.append(time.time())
        return [
            GpuSample(gpus[0].uuid, util0[i], mem0[i], 16 * GIB, power_w=100.0),
            GpuSample(gpus[1].uuid, 0.5, 3 * GIB, 16 * GIB, power_w=None, energy_mj=5_000 + 1_000 * i),
        ]

    job = sh(f"touch {started}; while [ ! -e {go} ]; do sleep 0.02; done", gpus=2)
    async with running_worker(
        queue, tmp_path / "w", gpus=gpus, slots=1, gpu_sampler=sampler, heartbeat_seconds=0.03
    ) as worker:
        job_id, _ = await queue.enqueue(job)
        info = await wait_state(queue, job_id, JobState.SUCCEEDED, timeout=20)
        scraped = worker.metrics.registry.get_sample_value(
            "gpupool_job_gpu_efficiency_count", {"queue": "default"}
        )
    usage = info.gpu_usage
    assert usage is not None
    one, two = usage["gpus"]
    assert (one["uuid"], one["samples"], two["samples"]) == (gpus[0].uuid, 20, 20)
    assert one["util_mean"] == 47.5
    assert one["util_p95"] == nearest_rank([u * 100 for u in util0], 0.95) == 90
    assert one["mem_peak"] == max(mem0) == 10 * GIB
    # Energy is each GPU's mean power between its readings carried over the whole attempt, so
    # at least what its readings span: GPU 0's 100 W over at least 19 intervals of 0.03 s, GPU
    # 1's energy counter's rise of 19 steps of 1 J
    assert one["energy_j"] >= 100.0 * 19 * 0.03
    assert one["energy_j"] >= 100.0 * (times[-1] - times[0]) - 100.0 * 0.25
    assert two["energy_j"] >= 19.0
    assert two["util_mean"] == two["util_p95"] == 50
    whole = [u * 100 for u in util0] + [50.0] * 20
    assert usage["util_mean"] == sum(whole) / len(whole)
    assert usage["util_p95"] == nearest_rank(whole, 0.95)
    assert usage["mem_peak"] == 10 * GIB
    assert usage["efficiency"] == (0.475 + 0.5) / 2
    assert usage["samples"] == 40
    assert webhook.end_record(info.to_dict())["gpu_usage"] == usage
    assert scraped == 1


def flags(info: JobInfo) -> str:
    return "" if info.idle_gpu is None else str(info.idle_gpu.get("action"))


async def test_idle_gpu_jobs_are_flagged_and_their_queues_policy_requeues_or_cancels(
    queue: JobQueue, tmp_path: Path
) -> None:
    """Issue 50, idle GPUs: four jobs on one GPU each. The busy one (its GPU reads 90 %) is never
    flagged; an idle one (1 %) in a queue without a policy is flagged after idle_gpu_minutes (its
    log says so, its record has `idle_gpu`) and runs on; one in a requeue queue goes back to its
    queue after the grace (its next attempt runs); one in a cancel queue is cancelled."""
    gpus = fake_gpus(4)
    busy_dir = tmp_path / "busy"
    busy_dir.mkdir()
    go = tmp_path / "go"

    def sampler() -> list[GpuSample]:
        """A GPU is busy while its job has left a file named after it (as work on it would)."""
        return [GpuSample(g.uuid, 0.9 if (busy_dir / g.uuid).exists() else 0.01, GIB, 16 * GIB) for g in gpus]

    wait = f"while [ ! -e {go} ]; do sleep 0.02; done"
    policy = IdlePolicy(
        util=5, minutes=0.5 / 60, grace_minutes=0.4 / 60, requeue_queues=["again"], cancel_queues=["strict"]
    )
    async with idle_watched_worker(
        queue, tmp_path, gpus, sampler, policy, queues=["default", "again", "strict"], slots=4
    ):
        busy, _ = await queue.enqueue(sh(f"touch {busy_dir}/$CUDA_VISIBLE_DEVICES; {wait}", gpus=1))
        idle, _ = await queue.enqueue(sh(wait, gpus=1))
        # its second attempt works (and ends): the requeue gave it another go
        again, _ = await queue.enqueue(sh(f'[ "$GPUPOOL_ATTEMPT" -gt 1 ] || {wait}', gpus=1, queue="again"))
        strict, _ = await queue.enqueue(sh(wait, gpus=1, queue="strict"))

        cancelled = await wait_state(queue, strict, JobState.CANCELLED, timeout=15)
        assert flags(cancelled) == "cancel"
        requeued = await wait_state(queue, again, JobState.SUCCEEDED, timeout=15)
        assert flags(requeued) == "requeue"
        assert requeued.idle_gpu is not None
        assert requeued.idle_gpu["attempt"] == 1
        assert requeued.attempts[0].how == "released"  # handed back, not failed

        async def flagged() -> bool:
            return (await queue.get(idle)).idle_gpu is not None

        await wait_until(flagged, 10, "the idle job's flag")
        info = await queue.get(idle)
        assert info.state is JobState.RUNNING  # flagged, not stopped: its queue has no policy
        assert info.idle_gpu is not None
        assert info.idle_gpu["action"] is None
        assert info.idle_gpu["minutes"] >= 0.5 / 60
        log = b"".join(d for _, d in await queue.read_log(idle)).decode()
        assert "[gpupool] its GPUs were below 5 % for" in log
        assert "flagged as idle" in log
        assert (await queue.get(busy)).idle_gpu is None
        go.touch()
        for job_id in (busy, idle):
            await wait_state(queue, job_id, JobState.SUCCEEDED, timeout=15)
    assert (await queue.get(busy)).idle_gpu is None
    assert webhook.end_record((await queue.get(idle)).to_dict())["idle_gpu"]["attempt"] == 1


async def test_a_poold_worker_reads_usage_through_nvml_and_cancels_an_idle_gpu_job_by_its_config(
    queue: JobQueue, redis_server: EmbeddedRedis, s3_env: dict[str, str]
) -> None:
    """Issue 50, end to end in a real `poold --worker` process on made-up NVML devices
    (tests/support/nvml_seam) whose readings the jobs set themselves: NVML's utilisation, memory
    and power reach the busy job's summary (37 % mean and p95, 5 GiB peak, energy from 200 W),
    and the idle_gpu_* options, given as flags, flag and then cancel the job that leaves its GPU
    idle in a queue named in idle_gpu_cancel_queues."""
    readings = Path(tempfile.mkdtemp(prefix="gpupool-nvml-"))
    readings.chmod(0o1777)  # the jobs, as slot uids, set their own GPU's readings
    busy_reading = orjson.dumps({"util": 37, "mem_used": 5 * GIB, "power_w": 200}).decode()
    options = (
        "--heartbeat-interval", "0.1", "--idle-gpu-minutes", str(0.5 / 60),
        "--idle-gpu-grace-minutes", str(0.3 / 60), "--idle-gpu-cancel-queues", "default",
    )  # fmt: skip
    with (
        contextlib.ExitStack() as cleanup,
        gpu_worker(redis_server, s3_env, {"FAKE_NVML_READINGS": str(readings)}, *options),
    ):
        cleanup.callback(shutil.rmtree, readings, ignore_errors=True)
        busy, _ = await queue.enqueue(
            sh(f"echo '{busy_reading}' > {readings}/$CUDA_VISIBLE_DEVICES; sleep 1.5", gpus=1)
        )
        idle, _ = await queue.enqueue(sh("sleep 60", gpus=1))
        cancelled = await wait_state(queue, idle, JobState.CANCELLED, timeout=30)
        assert cancelled.idle_gpu is not None
        assert cancelled.idle_gpu["action"] == "cancel"
        log = b"".join(d for _, d in await queue.read_log(idle)).decode()
        assert "flagged as idle; it is cancelled after" in log
        assert "its queue cancels jobs that leave GPUs idle" in log
        info = await wait_state(queue, busy, JobState.SUCCEEDED, timeout=30)
    assert info.idle_gpu is None
    usage = info.gpu_usage
    assert usage is not None
    # (read at 0 % until the job set its reading: its mean is at most 37 %, its p95 37 %)
    assert (usage["util_p95"], usage["mem_peak"]) == (37, 5 * GIB)
    assert 0 < usage["util_mean"] <= 37
    assert usage["efficiency"] == round(usage["util_mean"] / 100, 4)
    assert usage["energy_j"] > 0  # 200 W between its readings that had it


def test_energy_is_unknown_from_one_reading_and_spans_the_whole_attempt() -> None:
    """Issue 50, per-job GPU usage (energy): one reading measures no interval, so a job read
    once has unknown energy, not 0 J; a 9 s attempt at a steady 300 W read at 2.5, 5.5 and 8.5 s
    used 2700 J, not the 1800 J between its first and last readings, by the counter or by power."""
    for reading in ({"power_w": 300.0}, {"energy_mj": 5_000_000}):
        once = GpuUsage([(0, "GPU-a")], started=1000.0)
        once.add([GpuSample("GPU-a", 0.9, 1, 2, **reading)], 1001.0)
        summary = once.summary(ended=1002.0)
        assert summary is not None
        assert summary["energy_j"] is None
        assert summary["gpus"][0]["energy_j"] is None
    for by_counter in (True, False):
        usage = GpuUsage([(0, "GPU-a")], started=1000.0)
        for t in (2.5, 5.5, 8.5):
            extra = {"energy_mj": int(300_000 * t)} if by_counter else {"power_w": 300.0}
            usage.add([GpuSample("GPU-a", 0.9, 1, 2, **extra)], 1000.0 + t)
        summary = usage.summary(ended=1009.0)
        assert summary is not None
        assert summary["energy_j"] == 2700.0, (by_counter, summary)


async def accounting_records(queue: JobQueue, name: str) -> list[list[bytes]]:
    """The accounting records of queue `name`'s jobs that ended yesterday or today (lib/account.lua)."""
    today = accounting.day_of(time.time())
    return [
        r
        for day in (today - 1, today)
        async for page in accounting.read_day(queue.redis, name, day)
        for r in page
    ]


async def test_a_requeued_idle_jobs_measured_attempt_counts_in_its_accounting_record(
    queue: JobQueue, tmp_path: Path
) -> None:
    """issue 50, a review's finding 1: a job the idle-GPU policy hands back ran an attempt its
    worker measured (1 % until it is told to stop); its accounting record carries that attempt's
    utilisation, as a completed attempt's does. The hand-back counted the attempt's GPU-ms but
    not its measurement: the record read '-' (no attempt measured), and `poolctl acct` left it
    out. Its second attempt reads 90 % from its start (measured or not, as it ends at once:
    review 50c finding 7), so the record's mean is below 90 only if the first attempt counts."""
    gpus = fake_gpus(1)
    stopped = tmp_path / "stopped"  # the first attempt was told to stop: the readings go up

    def sampler() -> list[GpuSample]:
        return [GpuSample(gpus[0].uuid, 0.9 if stopped.exists() else 0.01, GIB, 16 * GIB)]

    policy = IdlePolicy(util=5, minutes=0.3 / 60, grace_minutes=0.2 / 60, requeue_queues=["again"])
    async with idle_watched_worker(queue, tmp_path, gpus, sampler, policy, queues=["again"], slots=1):
        script = (
            f'[ "$GPUPOOL_ATTEMPT" -gt 1 ] && exit 0; trap "touch {stopped}; exit 143" TERM; '
            "while :; do sleep 0.05; done"
        )
        job_id, _ = await queue.enqueue(sh(script, gpus=1, queue="again"))
        info = await wait_state(queue, job_id, JobState.SUCCEEDED, timeout=20)
    assert info.attempts[0].how == "released"
    (record,) = await accounting_records(queue, "again")
    assert int(record[3]) > 0  # GPU-ms, both attempts'
    # its mean utilisation: the handed-back attempt's (about 1 %), with the second's 90 % if measured
    assert record[5] != b"-", record
    assert 1 <= float(record[5]) < 90, record


async def test_an_idle_gpu_policy_due_while_a_job_ends_otherwise_does_not_claim_its_end(
    queue: JobQueue, tmp_path: Path
) -> None:
    """issue 50, a review's finding 2: a job its user cancelled takes its time over its stop
    signal (it goes on until SIGKILL, --stop-grace 4 s), leaving its GPU idle meanwhile; its
    queue's idle policy (requeue) comes due before it is gone. The job ends as its user
    cancelled it, so its record must not say the policy stopped it: `idle_gpu` is the flag
    alone (action null), and no line in its log says its queue requeued it. The policy recorded
    "requeue" whatever stop was under way (and a job that ends as a drain or its GPU's health
    handed it back was as wrongly recorded)."""
    gpus = fake_gpus(1)
    started, stopping = tmp_path / "started", tmp_path / "stopping"

    def sampler() -> list[GpuSample]:
        """Busy until the job is told to stop; idle from then on."""
        return [GpuSample(gpus[0].uuid, 0.01 if stopping.exists() else 0.9, GIB, 16 * GIB)]

    policy = IdlePolicy(util=5, minutes=0.3 / 60, grace_minutes=0.3 / 60, requeue_queues=["again"])
    async with idle_watched_worker(queue, tmp_path, gpus, sampler, policy, queues=["again"], slots=1):
        script = f"trap 'touch {stopping}' TERM; touch {started}; while :; do sleep 0.05; done"
        job_id, _ = await queue.enqueue(sh(script, gpus=1, queue="again", stop_grace=4))

        async def running() -> bool:
            return started.exists()

        await wait_until(running, 15, "the job to start")
        await queue.cancel(job_id)
        info = await wait_state(queue, job_id, JobState.CANCELLED, timeout=20)
    log = b"".join(d for _, d in await queue.read_log(job_id)).decode()
    assert "flagged as idle; it is requeued after" in log  # idle while it stopped: flagged
    assert "its queue requeues jobs that leave GPUs idle" not in log
    assert info.idle_gpu is not None
    assert info.idle_gpu["action"] is None, info.idle_gpu
    assert info.attempt == 1
