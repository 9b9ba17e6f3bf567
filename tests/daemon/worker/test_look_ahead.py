"""Look-ahead (daemon/worker/fast_path.py), with a real redis-server and real processes: a worker
of short jobs keeps jobs claimed ahead of a free slot, and each thing that could make such a job
wait, run twice or run when it should not is tried: a long job in the way, another worker idle, a
cancel, a drain, a worker with GPUs."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from daemon.job import JobState, Lease
from daemon.queue import keys
from daemon.queue.job_queue import JobQueue
from daemon.worker import fast_path as look_ahead
from daemon.worker.dispatcher import Worker
from tests.support.workers import (
    fake_gpus,
    note_lingers,
    running_worker,
    sh,
    wait_file,
    wait_state,
    wait_until,
)


def held_until_released(tmp_path: Path, name: str) -> str:
    """A job that says it started (file NAME.started), then runs until NAME.go exists."""
    at = tmp_path / name
    return f"echo started > {at}.started; while [ ! -e {at}.go ]; do sleep 0.02; done"


def marks(tmp_path: Path, name: str) -> str:
    """A job that leaves file NAME.ran."""
    return f"echo $GPUPOOL_ATTEMPT > {tmp_path}/{name}.ran"


async def kept_ahead(queue: JobQueue, worker: Worker, job_id: str) -> None:
    """Wait until `worker` holds `job_id` claimed (running, its lease) while it has not started."""

    async def held() -> bool:
        info = await queue.get(job_id)
        return info.state is JobState.RUNNING and info.worker == worker.id and job_id not in worker.running

    await wait_until(held, timeout=15, what=f"{job_id} kept ahead by {worker.id}")


async def test_a_worker_of_short_jobs_claims_two_ahead_and_starts_each_as_its_slot_frees(
    queue: JobQueue, tmp_path: Path
) -> None:
    short, _ = await queue.enqueue(sh("true"))
    first, _ = await queue.enqueue(sh(held_until_released(tmp_path, "first")))
    ahead = [(await queue.enqueue(sh(marks(tmp_path, f"ahead{n}"))))[0] for n in range(look_ahead.DEPTH)]
    behind, _ = await queue.enqueue(sh(marks(tmp_path, "behind")))
    async with running_worker(queue, tmp_path / "w", slots=1, look_ahead_hold=60) as worker:
        await wait_file(tmp_path / "first.started")
        for job_id in ahead:
            await kept_ahead(queue, worker, job_id)
        await asyncio.sleep(0.5)  # DEPTH ahead, no more: the next stays queued, and nothing ran
        assert (await queue.get(behind)).state is JobState.QUEUED
        assert not list(tmp_path.glob("ahead*.ran"))
        (tmp_path / "first.go").touch()
        infos = [await wait_state(queue, j, JobState.SUCCEEDED) for j in (short, first, *ahead, behind)]
    # FIFO: claimed in enqueue order; those kept ahead ran once each, as their first attempt
    starts = [info.started_at or 0.0 for info in infos]
    assert starts == sorted(starts)
    for n, info in enumerate(infos[2:-1]):
        assert [a.how for a in info.attempts] == ["succeeded"]
        assert (tmp_path / f"ahead{n}.ran").read_text().split() == ["1"]


async def test_a_job_kept_ahead_behind_a_long_one_goes_back_to_the_front_for_another_worker(
    queue: JobQueue, tmp_path: Path
) -> None:
    await queue.enqueue(sh("true"))
    await queue.enqueue(sh(held_until_released(tmp_path, "long")))
    ahead, _ = await queue.enqueue(sh(marks(tmp_path, "ahead")))
    async with running_worker(queue, tmp_path / "w1", slots=1, look_ahead_hold=0.5) as w1:
        await wait_file(tmp_path / "long.started")
        await kept_ahead(queue, w1, ahead)
        # not started within the hold: handed back, and not claimed ahead again (the last job to
        # end here was short, but a job kept ahead waited too long: it looks ahead no more)
        info = await wait_state(queue, ahead, JobState.QUEUED, timeout=15)
        await asyncio.sleep(1.5)  # three holds: a worker that kept claiming would have by now
        info = await queue.get(ahead)
        assert info.state is JobState.QUEUED
        assert [a.how for a in info.attempts] == ["released"]
        # another worker runs it while the long job still runs on the first
        async with running_worker(queue, tmp_path / "w2", slots=1) as w2:
            info = await wait_state(queue, ahead, JobState.SUCCEEDED)
            assert info.worker == w2.id
            assert not (tmp_path / "long.go").exists()
        (tmp_path / "long.go").touch()
    assert [a.how for a in info.attempts] == ["released", "succeeded"]
    assert (tmp_path / "ahead.ran").read_text().split() == ["2"]


async def test_a_job_cancelled_while_kept_ahead_never_runs(queue: JobQueue, tmp_path: Path) -> None:
    await queue.enqueue(sh("true"))
    first, _ = await queue.enqueue(sh(held_until_released(tmp_path, "first")))
    ahead, _ = await queue.enqueue(sh(marks(tmp_path, "ahead")))
    async with running_worker(queue, tmp_path / "w", slots=1, look_ahead_hold=60) as worker:
        await wait_file(tmp_path / "first.started")
        await kept_ahead(queue, worker, ahead)
        assert await queue.cancel(ahead) == "cancelling"
        info = await wait_state(queue, ahead, JobState.CANCELLED, timeout=15)
        (tmp_path / "first.go").touch()
        await wait_state(queue, first, JobState.SUCCEEDED)
    assert not (tmp_path / "ahead.ran").exists()
    assert [a.how for a in info.attempts] == ["released"]


async def test_a_draining_worker_hands_back_the_job_kept_ahead_first(queue: JobQueue, tmp_path: Path) -> None:
    await queue.enqueue(sh("true"))
    first, _ = await queue.enqueue(sh(held_until_released(tmp_path, "first")))
    ahead, _ = await queue.enqueue(sh(marks(tmp_path, "ahead")))
    async with running_worker(queue, tmp_path / "w", slots=1, look_ahead_hold=60, drain_timeout=30) as worker:
        await wait_file(tmp_path / "first.started")
        await kept_ahead(queue, worker, ahead)
        stopping = asyncio.create_task(worker.stop())
        # back in the queue while the running job may still finish
        info = await wait_state(queue, ahead, JobState.QUEUED, timeout=15)
        assert not stopping.done()
        (tmp_path / "first.go").touch()
        await asyncio.wait_for(stopping, 30)
    assert (await queue.get(first)).state is JobState.SUCCEEDED
    assert [a.how for a in info.attempts] == ["released"]
    assert not (tmp_path / "ahead.ran").exists()


async def test_a_worker_with_gpus_claims_nothing_ahead(queue: JobQueue, tmp_path: Path) -> None:
    # Two slots of four GPUs, jobs of one GPU each: GPUs are free while both slots are taken, so a
    # claim ahead would get the next job; a worker with GPUs makes none.
    await queue.enqueue(sh("true", gpus=1))
    for name in ("a", "b"):
        await queue.enqueue(sh(held_until_released(tmp_path, name), gpus=1))
    second, _ = await queue.enqueue(sh(marks(tmp_path, "second"), gpus=1))
    async with running_worker(queue, tmp_path / "w", slots=2, gpus=fake_gpus(4), look_ahead_hold=60):
        await wait_file(tmp_path / "a.started")
        await wait_file(tmp_path / "b.started")
        await asyncio.sleep(1.0)  # a worker without GPUs claims it ahead within a few ms
        assert (await queue.get(second)).state is JobState.QUEUED
        (tmp_path / "a.go").touch()
        (tmp_path / "b.go").touch()
        await wait_state(queue, second, JobState.SUCCEEDED)


async def test_outcomes_wait_for_company_only_while_short_jobs_flow_and_another_runs(
    queue: JobQueue, tmp_path: Path
) -> None:
    """While short jobs flow, an outcome may wait a little for the next job's (look_ahead.LINGER),
    to share its round trip; a job that ends with nothing else running is recorded at once. Each
    job still runs once, and is recorded once."""
    lingers = note_lingers(queue)
    flow = [(await queue.enqueue(sh("true")))[0] for _ in range(30)]
    async with running_worker(queue, tmp_path / "w", slots=2) as worker:
        infos = [await wait_state(queue, job_id, JobState.SUCCEEDED) for job_id in flow]

        async def recorded() -> bool:
            return not worker.leases()

        await wait_until(recorded, timeout=15, what="every outcome recorded")
        alone, _ = await queue.enqueue(sh("true"))
        await wait_state(queue, alone, JobState.SUCCEEDED)
    assert all([a.how for a in info.attempts] == ["succeeded"] for info in infos)
    assert {lingers[job_id] for job_id in flow} >= {look_ahead.LINGER}
    assert lingers[alone] == 0.0


async def test_a_job_kept_ahead_counts_as_started_when_it_starts(queue: JobQueue, tmp_path: Path) -> None:
    """issue 43 item 7 (look-ahead): the worker tells Redis when a job it kept ahead starts, so its
    attempt counts from then: fair share bills it from when it started, not from when it was
    claimed, and from then a reclaim counts it as run."""
    # The script loaded first: a first call's NOSCRIPT answer sends it again after the calls behind it.
    assert await queue.mark_started(Lease("default.none0000", 1, "w", sh("true"), "w/1.1")) == 0
    await queue.enqueue(sh("true"))
    await queue.enqueue(sh(held_until_released(tmp_path, "first")))
    ahead = [(await queue.enqueue(sh(marks(tmp_path, f"ahead{n}"))))[0] for n in range(look_ahead.DEPTH)]
    async with running_worker(queue, tmp_path / "w", slots=1, look_ahead_hold=60) as worker:
        await wait_file(tmp_path / "first.started")
        for job_id in ahead:
            await kept_ahead(queue, worker, job_id)
        assert all([await queue.redis.hget(keys.job(j), "ahead") == b"1" for j in ahead])
        await asyncio.sleep(0.3)  # held a while: claimed well before they can start
        released = time.time()
        (tmp_path / "first.go").touch()
        infos = [await wait_state(queue, j, JobState.SUCCEEDED) for j in ahead]
    for info in infos:
        ran_from = int(await queue.redis.hget(keys.job(info.id), "ran_from") or 0) / 1000
        assert ran_from >= released - 0.005  # (this machine's clock, as Redis's)
        assert (info.started_at or 0) < released  # (its claim's time: what FIFO is judged by)
