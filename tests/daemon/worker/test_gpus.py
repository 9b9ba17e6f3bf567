"""GPU discovery and assignment (daemon/worker/gpus.py), through the seam: a made-up GPU list."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import pytest
from redis.asyncio import Redis

from daemon.job import JobSpec, JobState
from daemon.queue.job_queue import JobQueue
from daemon.queue.registry import list_workers
from daemon.worker import leftovers
from daemon.worker.gpus import GpuAllocator, NotEnoughGpus, discover, recheck_quarantine, visible_devices
from daemon.worker.nvml_asks import NVML_READ_SECONDS, GpuAsks
from tests.support.workers import fake_gpus, running_worker, wait_file, wait_state, wait_until


def indexes(gpus: tuple[object, ...]) -> list[int]:
    return [g.index for g in gpus]  # type: ignore[attr-defined]


def test_slots_divide_the_gpus_and_a_job_asking_for_none_gets_its_slots_share() -> None:
    alloc = GpuAllocator(fake_gpus(4), slots=2)
    assert alloc.share == 2
    assert indexes(alloc.allocate("a#1", 0, slot=1)) == [2, 3]
    assert indexes(alloc.allocate("b#1", 0, slot=0)) == [0, 1]
    assert alloc.free_count() == 0
    with pytest.raises(NotEnoughGpus):
        alloc.allocate("c#1", 0, slot=0)
    alloc.release("a#1")
    assert indexes(alloc.allocate("c#1", 0, slot=1)) == [2, 3]


def test_n_gpu_jobs_take_free_gpus_own_slot_first_then_spares() -> None:
    alloc = GpuAllocator(fake_gpus(5), slots=2)  # share 2; GPU 4 is no slot's home
    assert indexes(alloc.allocate("big#1", 3, slot=1)) == [2, 3, 4]
    assert indexes(alloc.allocate("one#1", 1, slot=1)) == [0]  # its own home is taken
    assert alloc.free_count() == 1
    with pytest.raises(NotEnoughGpus):
        alloc.allocate("two#1", 2, slot=0)
    assert alloc.free_count() == 1  # a refused allocation holds nothing


def test_a_gpu_is_never_handed_to_two_jobs() -> None:
    alloc = GpuAllocator(fake_gpus(8), slots=3)
    held: dict[str, str] = {}
    for n, (want, slot) in enumerate([(0, 0), (3, 1), (1, 2), (2, 0)]):  # 2 + 3 + 1 + 2 = 8
        for g in alloc.allocate(f"job{n}#1", want, slot):
            assert g.uuid not in held
            held[g.uuid] = f"job{n}"
    assert alloc.free_count() == 0
    alloc.release("job1#1")
    assert alloc.free_count() == 3
    assert {g.uuid for g in alloc.allocate("again#1", 3, 0)} == {u for u, j in held.items() if j == "job1"}


def test_quarantined_gpus_are_not_handed_out_until_clean() -> None:
    alloc = GpuAllocator(fake_gpus(2), slots=1)
    gpus = alloc.allocate("a#1", 0, slot=0)
    alloc.quarantine(gpus[0].uuid, "memory still held")
    alloc.release("a#1")
    assert [g.index for g in alloc.free()] == [1]
    with pytest.raises(NotEnoughGpus):
        alloc.allocate("b#1", 0, slot=0)  # the slot's share is 2: only 1 is usable
    assert indexes(alloc.allocate("b#1", 1, slot=0)) == [1]
    assert alloc.describe()[0]["quarantined"] == "memory still held"
    alloc.unquarantine(gpus[0].uuid)
    assert alloc.free_count() == 1


def test_fewer_gpus_than_slots_and_cpu_workers() -> None:
    alloc = GpuAllocator(fake_gpus(1), slots=2)
    assert (alloc.share, alloc.allocate("a#1", 0, slot=0)) == (0, ())  # ask with gpus=1
    assert indexes(alloc.allocate("b#1", 1, slot=1)) == [0]
    cpu = GpuAllocator([], slots=2)
    assert (cpu.share, cpu.free_count(), cpu.allocate("c#1", 0, slot=0)) == (0, 0, ())
    assert visible_devices(()) == ""
    assert visible_devices(fake_gpus(2)) == "GPU-00000000-fake,GPU-00000001-fake"


def test_no_driver_means_a_cpu_worker_said_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="daemon.worker.gpus")
    gpus, nvml = discover()  # this machine has no NVIDIA driver
    if nvml is not None:  # pragma: no cover - a GPU machine
        nvml.close()
        pytest.skip("this machine has GPUs")
    assert gpus == []
    assert [r.message for r in caplog.records if "CPU worker" in r.message] != []
    assert len(caplog.records) == 1


async def test_cuda_visible_devices_and_no_double_hand_out_in_a_worker(
    queue: JobQueue, tmp_path: Path
) -> None:
    # Each job logs "start GPUs" / "end GPUs" to one file (appends are atomic): for every GPU the
    # lines must alternate start, end, start, end: no two jobs ever held it at once.
    ledger = tmp_path / "ledger"
    log = f'echo "%s $CUDA_VISIBLE_DEVICES" >> {ledger}'
    script = f"{log % 'start'}; sleep 0.1; {log % 'end'}"
    wants = [0, 1, 2, 0, 3, 1, 0, 2, 1, 0]
    ids = [(await queue.enqueue(JobSpec(argv=("sh", "-c", script), gpus=n)))[0] for n in wants]
    async with running_worker(queue, tmp_path / "w", slots=2, gpus=fake_gpus(4)):
        for job_id in ids:
            await wait_state(queue, job_id, JobState.SUCCEEDED)
    holding: dict[str, bool] = {}
    seen_counts = []
    for line in ledger.read_text().splitlines():
        what, devices = line.split(" ", 1)
        uuids = devices.split(",")
        assert all(u.startswith("GPU-") and u.endswith("-fake") for u in uuids)  # by UUID
        if what == "start":
            seen_counts.append(len(uuids))
        for uuid in uuids:
            assert holding.get(uuid, False) is (what == "end"), line
            holding[uuid] = what == "start"
    assert sorted(seen_counts) == sorted(n or 2 for n in wants)  # 0 means the slot's share: 2


async def test_a_cpu_worker_passes_over_a_gpu_job_and_runs_the_jobs_behind_it(
    queue: JobQueue, redis: Redis, tmp_path: Path
) -> None:
    """Issue 12 item 1: a job needing GPUs this worker has none of used to block its queue for good
    ("1 job(s) ahead of it"); it is passed over, the jobs behind it run, and it waits, at the
    front, for a worker that has the GPUs."""
    gpu_job, _ = await queue.enqueue(JobSpec(argv=("true",), gpus=1))
    cpu_job, _ = await queue.enqueue(JobSpec(argv=("true",)))
    async with running_worker(queue, tmp_path / "cpu"):
        await wait_state(queue, cpu_job, JobState.SUCCEEDED)
        assert (await queue.get(gpu_job)).state is JobState.QUEUED
        assert await queue.depth("default") == 1
        async with running_worker(queue, tmp_path / "gpu", gpus=fake_gpus(1), slots=1):
            info = await wait_state(queue, gpu_job, JobState.SUCCEEDED)
    assert info.result["gpus"] == ["GPU-00000000-fake"]


async def _registered(redis: Redis) -> bool:
    return bool(await list_workers(redis))


class FakeProbe:
    """Stands in for NVML after a job: the pids in `pidfile` hold memory on GPU 0."""

    def __init__(self, pidfile: Path) -> None:
        self.pidfile = pidfile
        self.clean = False

    def compute_pids(self, uuid: str) -> set[int]:
        if self.clean or uuid != "GPU-00000000-fake" or not self.pidfile.exists():
            return set()
        return {int(p) for p in self.pidfile.read_text().split()}


async def test_a_gpu_left_dirty_is_quarantined_and_reported(
    queue: JobQueue, redis: Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(leftovers, "GPU_SETTLE_SECONDS", 0.2)
    probe = FakeProbe(tmp_path / "pid")
    dirty, _ = await queue.enqueue(JobSpec(argv=("sh", "-c", f"echo $$ > {probe.pidfile}"), gpus=1))
    async with running_worker(queue, tmp_path / "w", slots=1, gpus=fake_gpus(2), probe=probe) as worker:
        await wait_state(queue, dirty, JobState.SUCCEEDED)
        await wait_until(lambda: _quarantined(worker.gpu_books.allocator.quarantined), what="the quarantine")
        assert "still hold memory" in worker.gpu_books.allocator.quarantined["GPU-00000000-fake"]
        # the next jobs get the clean GPU only
        seen = tmp_path / "seen"
        for _ in range(2):
            job, _ = await queue.enqueue(
                JobSpec(argv=("sh", "-c", f"echo $CUDA_VISIBLE_DEVICES >> {seen}"), gpus=1)
            )
            await wait_state(queue, job, JobState.SUCCEEDED)
        assert set(await wait_file(seen, 2)) == {"GPU-00000001-fake"}
        await wait_until(lambda: _reported(redis), what="the quarantine in the registration")
        # once no process holds memory on it, it is checked clean after the next job and returns
        probe.clean = True
        job, _ = await queue.enqueue(JobSpec(argv=("true",), gpus=1))
        await wait_state(queue, job, JobState.SUCCEEDED)
        await wait_until(
            lambda: _quarantined({}, worker.gpu_books.allocator.quarantined), what="the GPU to return"
        )


async def _quarantined(quarantined: dict[str, str], expected: dict[str, str] | None = None) -> bool:
    return bool(quarantined) if expected is None else expected == quarantined


async def _reported(redis: Redis) -> bool:
    [record] = await list_workers(redis)
    return any(g["quarantined"] for g in record["gpus"])


async def test_a_quarantine_recheck_waits_for_nvml_within_a_bound_and_asks_once_at_a_time() -> None:
    """Issue 50, a review's finding: the quarantine recheck, run at every job's end, waited for
    NVML without a bound once, then asked again at each job's end while the last ask still hung:
    a hung GPU piled up a thread per job end. An unanswered ask leaves the GPU quarantined after
    NVML_READ_SECONDS; the next rechecks do not ask it again while it hangs; once it answers
    (clean), the GPU comes back."""
    gpus = fake_gpus(2)
    allocator = GpuAllocator(gpus, slots=1)
    allocator.quarantine(gpus[0].uuid, "after job default.x: processes [7] still hold memory on it")
    release, asked = threading.Event(), []

    class HangingProbe:  # NVML hung on GPU 0 until released
        def compute_pids(self, uuid: str) -> set[int]:
            asked.append(uuid)
            release.wait(30)
            return set()

    asks: GpuAsks[set[int]] = GpuAsks("test-gpu-clean")
    try:
        async with asyncio.timeout(NVML_READ_SECONDS + 20):  # the bound, and a margin
            assert await recheck_quarantine(allocator, HangingProbe(), asks) is False
            assert gpus[0].uuid in allocator.quarantined
            for _ in range(3):  # more jobs end while it hangs: no new ask
                assert await recheck_quarantine(allocator, HangingProbe(), asks) is False
            assert asked == [gpus[0].uuid]
            release.set()

            async def back() -> bool:
                return await recheck_quarantine(allocator, HangingProbe(), asks)

            await wait_until(back, 10, "the GPU back once NVML answered")
        assert gpus[0].uuid not in allocator.quarantined
    finally:
        release.set()


async def test_the_end_checks_of_jobs_on_a_gpu_whose_nvml_hangs_hold_one_thread(
    queue: JobQueue, tmp_path: Path
) -> None:
    """A final review's finding 3: each job's end check (leftovers.check_gpus) made asks of its
    own, so each job that ended on a GPU whose NVML hangs left one more thread hung in NVML, and
    the quarantine check beside them one more. The worker's checks of a GPU's processes share
    one ask per GPU: however many jobs end on it while it hangs, it holds one thread."""
    gpu = fake_gpus(1)
    release, asked = threading.Event(), []

    class HangingProbe:  # NVML hung on the GPU until released
        def compute_pids(self, uuid: str) -> set[int]:
            asked.append(uuid)
            release.wait(60)
            return set()

    try:
        async with running_worker(queue, tmp_path / "w", slots=1, gpus=gpu, probe=HangingProbe()) as worker:
            allocator = worker.gpu_books.allocator

            async def dirty() -> bool:  # counted dirty: NVML did not answer for it
                return "NVML does not answer" in allocator.quarantined.get(gpu[0].uuid, "")

            for _ in range(2):
                job, _ = await queue.enqueue(JobSpec(argv=("true",), gpus=1))
                await wait_state(queue, job, JobState.SUCCEEDED)  # within NVML_READ_SECONDS of its end
                # counted dirty: NVML did not answer for it
                await wait_until(dirty, 10, "the GPU counted dirty")
                # as its quarantine check would, had NVML answered it: the next job may take it
                allocator.unquarantine(gpu[0].uuid)
            assert asked == [gpu[0].uuid]
    finally:
        release.set()
