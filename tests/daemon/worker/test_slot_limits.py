"""A slot's CPU and memory limits (daemon/worker/slot_limits.py, issue 50): a job is held to its
`--cpus` and `--mem` by its slot's cgroups, and one past its memory fails saying so, the worker
untouched. Real cgroups, real worker processes: the tests run as root on a machine with cgroup
v1's memory, cpu and cpuacct hierarchies (skipped where there are none: a cgroup-v2-only machine
fits jobs' CPUs and memory without enforcing them, as the module says)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon.config import load
from daemon.job import JobState
from daemon.queue.job_queue import JobQueue
from daemon.worker import gpus
from daemon.worker.service import local_slot_count
from daemon.worker.slot_limits import SlotLimits, WorkerLimits, v1_dirs
from tests.support.workers import running_worker, sh, wait_state, wait_until

MIB = 2**20

needs_v1 = pytest.mark.skipif(
    os.geteuid() != 0 or v1_dirs() is None, reason="needs root and cgroup v1 memory, cpu and cpuacct"
)


@needs_v1
async def test_a_job_past_its_mem_fails_saying_so_and_the_worker_goes_on(
    queue: JobQueue, tmp_path: Path
) -> None:
    """issue 50, `--mem` enforced with the sentence: a job that writes 512 MiB with --mem 64M is
    ended by the kernel in its slot's cgroup, not the worker, and fails saying it ran out of its
    memory; the slot's next job, under a higher --mem, runs there within it."""
    grow = f"{sys.executable} -c 'b = bytearray(256 * 2**20); b[:] = b\"x\" * len(b)'"  # 512 MiB written
    async with running_worker(queue, tmp_path / "w", slots=1) as worker:
        assert worker._slots.limits is not None
        hog, _ = await queue.enqueue(sh(grow, mem=64 * MIB))
        info = await wait_state(queue, hog, JobState.SUCCEEDED, JobState.FAILED)
        assert info.state is JobState.FAILED
        assert info.detail.startswith("out of memory: used 64 MiB, its --mem of 64 MiB; the kernel killed 1 ")
        assert worker._dispatcher is not None
        assert not worker._dispatcher.done()  # the worker goes on
        after, _ = await queue.enqueue(sh(grow, mem=1024 * MIB))  # a higher limit than the last job's
        done = await wait_state(queue, after, JobState.SUCCEEDED, JobState.FAILED)
        assert done.state is JobState.SUCCEEDED, done.detail


@needs_v1
async def test_cpus_1_holds_a_spinning_job_to_one_cpus_time(queue: JobQueue, tmp_path: Path) -> None:
    """issue 50, `--cpus` limits a spinning job to its share: two busy processes under --cpus 1
    get at most about one CPU's time, as the slot's cgroup counts it (cpuacct), over the job's
    wall time: a ratio in one run (unlimited, two spinners get up to two CPUs' worth on an idle
    machine; a loaded one gives them less, so the quota itself is read too, while it runs)."""
    spin = "yes > /dev/null & a=$!; yes > /dev/null & b=$!; sleep 1.5; kill $a $b"
    async with running_worker(queue, tmp_path / "w", slots=1) as worker:
        assert worker._slots.limits is not None
        quota = worker._slots.limits.slot(0).dirs["cpu"] / "cpu.cfs_quota_us"
        job_id, _ = await queue.enqueue(sh(spin, cpus=1))

        async def quota_set() -> bool:  # one period's time in each (cpu.cfs_period_us), once it starts
            return quota.read_text().strip() == "100000"

        await wait_until(quota_set, timeout=10, what="the job's CPU quota")  # (it spins for 1.5 s)
        info = await wait_state(queue, job_id, JobState.SUCCEEDED, JobState.FAILED)
        assert info.state is JobState.SUCCEEDED, info.detail
        result = info.result or {}
        wall = result["ended_at"] - result["started_at"]
        assert 0 < result["cpu_seconds"] / wall < 1.1, (result["cpu_seconds"], wall)
        after, _ = await queue.enqueue(sh("true"))  # the next job, asking for none: no quota
        await wait_state(queue, after, JobState.SUCCEEDED)
        assert quota.read_text().strip() == "-1"


def test_the_default_slots_follow_the_cpus_this_process_may_run_on() -> None:
    """issue 50, default slots follow the machine's CPUs: a singlenode pool without GPUs runs a
    slot per CPU it may run on (its affinity, as `taskset` or a cpuset gives it), not per CPU of
    the machine (os.cpu_count()). This thread is held to one CPU for the look."""
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mine)})
    try:
        assert local_slot_count(load(env={})) == (gpus.count() or 1)
    finally:
        os.sched_setaffinity(0, mine)


@needs_v1
def test_what_a_job_left_charged_to_its_slot_reaches_no_later_job(tmp_path: Path) -> None:
    """issue 50, a review's finding: a file a job left on tmpfs (/dev/shm) stays charged to its
    slot's memory cgroup, unreclaimable without swap: the next job's smaller --mem could not be set
    (EBUSY: it failed, "cannot start"), a larger one started with the leftover counted. Each job
    has a memory cgroup of its own, fresh (what was charged before goes to the parent)."""
    limits = WorkerLimits.make(f"test-{os.getpid()}", 1)
    assert limits is not None
    slot = limits.slot(0)
    left = Path(f"/dev/shm/gpupool-test-{os.getpid()}")
    try:
        slot.apply(0, 0)
        joins = [str(p) for p in dict.fromkeys(slot.dirs.values())]
        leaves = f"import os\nfor d in {joins!r}: open(os.path.join(d, 'cgroup.procs'), 'w').write('0')\n"
        leaves += f"open({str(left)!r}, 'wb').write(b'x' * (64 << 20))\n"
        subprocess.run([sys.executable, "-c", leaves], check=True, timeout=30)
        slot.apply(1, 32 << 20)  # below what the last job left charged
        assert int((slot.dirs["memory"] / "memory.usage_in_bytes").read_text()) < 8 << 20
        assert int((slot.dirs["memory"] / "memory.limit_in_bytes").read_text()) == 32 << 20
    finally:
        left.unlink(missing_ok=True)
        limits.close()


@needs_v1
def test_a_kernel_without_swap_accounting_limits_memory_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """issue 50, a review's finding 8: the memory+swap limit was written unconditionally, and a
    kernel without swap accounting (swapaccount=0) has no memory.memsw.* files: every job failed
    to start (FileNotFoundError). A worker that finds none says at start that its jobs may swap
    past their --mem, and its slots write the memory limit alone. (Plain directories stand in for
    such a hierarchy where the worker looks; a real slot told so sets its limit: the kernel here
    accounts swap.)"""
    plain = {h: tmp_path / h for h in ("memory", "cpu", "cpuacct")}
    for d in plain.values():
        d.mkdir()
    with caplog.at_level(logging.WARNING, logger="daemon.worker.slot_limits"):
        without = WorkerLimits.make("test", 1, within=plain)
    assert without is not None
    assert not without.slot(0).swap
    assert "--mem limits their memory here, not their swap" in caplog.text
    without.close()
    real = WorkerLimits.make(f"test-{os.getpid()}", 1)
    assert real is not None
    try:
        assert real.slot(0).swap
        slot = SlotLimits(real.slot(0).dirs, swap=False)
        slot.apply(1, 64 * MIB)
        assert int((slot.dirs["memory"] / "memory.limit_in_bytes").read_text()) == 64 * MIB
        assert int((slot.dirs["memory"] / "memory.memsw.limit_in_bytes").read_text()) > 2**60  # none
        slot.close()
    finally:
        real.close()


@needs_v1
async def test_a_process_of_the_last_job_left_in_its_slot_reaches_not_the_next_job(
    queue: JobQueue, tmp_path: Path
) -> None:
    """issue 50, a review's findings 4 and 7: a process of the slot's last job still in its memory
    cgroup (being swept), holding 64 MiB on tmpfs and 256 MiB of page cache, kept that cgroup
    from being made anew: the next job's smaller --mem could not be set (EBUSY: it failed,
    "cannot start"), and setting it reclaimed the page cache on the worker's event loop first
    (a tenth of a second and more, every job of the worker waiting). The next job gets a memory
    cgroup of its own beside it: it runs within its --mem, counting none of that, and the loop
    goes on meanwhile (a ticker's longest gap)."""
    shm, cache = Path(f"/dev/shm/gpupool-test-{os.getpid()}"), tmp_path / "cache"
    async with running_worker(queue, tmp_path / "w", slots=1) as worker:
        assert worker._slots.limits is not None
        memory = worker._slots.limits.slot(0).dirs["memory"]
        stays = f"open({str(memory / 'cgroup.procs')!r}, 'w').write('0')\n"
        stays += f"open({str(shm)!r}, 'wb').write(b'x' * (64 << 20))\n"
        stays += f"f = open({str(cache)!r}, 'wb')\nfor _ in range(64): f.write(b'x' * (4 << 20))\n"
        stays += "f.close()\nprint('charged', flush=True)\nimport time; time.sleep(60)\n"
        lingers = subprocess.Popen([sys.executable, "-c", stays], stdout=subprocess.PIPE)
        try:
            assert lingers.stdout is not None
            assert await asyncio.wait_for(asyncio.to_thread(lingers.stdout.readline), 30) == b"charged\n"
            gaps = [0.0]

            async def tick() -> None:
                while True:
                    before = time.monotonic()
                    await asyncio.sleep(0.005)
                    gaps.append(time.monotonic() - before)

            ticker = asyncio.create_task(tick())
            try:
                job_id, _ = await queue.enqueue(sh("true", mem=32 * MIB))
                info = await wait_state(queue, job_id, JobState.SUCCEEDED, JobState.FAILED)
            finally:
                ticker.cancel()
            assert max(gaps) < 0.1, max(gaps)  # (the reclaim on the loop: twice that here)
            assert info.state is JobState.SUCCEEDED, info.detail
            assert (info.result or {})["peak_mem"] < 32 * MIB
        finally:
            lingers.kill()
            lingers.communicate()
            shm.unlink(missing_ok=True)


@needs_v1
async def test_limits_a_worker_cannot_set_hand_the_job_back_not_fail_it(
    queue: JobQueue, tmp_path: Path
) -> None:
    """issue 50, a review's finding 4: a limit the worker could not set failed the job ("cannot
    start 'sh' ...: Invalid argument"), though the fault was the worker's. Here the worker's own
    cgroup is held to one CPU, below which the kernel refuses a slot's quota of two: the attempt
    is handed back, saying why in the job's log, as a loss (a worker that can never set them
    does not take the job round for ever: at max_attempts it is dead, saying so); the worker
    goes on, and runs a job whose limits it can set."""
    async with running_worker(queue, tmp_path / "w", slots=1) as worker:
        assert worker._slots.limits is not None
        own = worker._slots.limits.slot(0).dirs["cpu"].parent / "cpu.cfs_quota_us"
        own.write_text("100000")  # one CPU's time
        try:
            job_id, _ = await queue.enqueue(sh("true", cpus=2, max_attempts=2))
            info = await wait_state(queue, job_id, JobState.SUCCEEDED, JobState.FAILED, JobState.DEAD)
            assert info.state is JobState.DEAD, info.detail
            assert "workers that could not set its CPU and memory limits: 2 attempts lost" in info.detail
            said = b"".join(data for _, data in await queue.read_log(job_id)).decode()
            assert "this worker could not set the job's CPU and memory limits (Invalid argument)" in said
            after, _ = await queue.enqueue(sh("true", cpus=1))
            done = await wait_state(queue, after, JobState.SUCCEEDED, JobState.FAILED)
            assert done.state is JobState.SUCCEEDED, done.detail
        finally:
            own.write_text("-1")
