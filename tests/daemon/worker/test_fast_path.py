"""issue 46: the GPU-less fast path's switch (daemon/worker/fast_path.py, daemon/queue/fast_path.py),
with a real redis-server and real processes. Off, a worker without GPUs of short jobs claims only
for its free slots, records each outcome as it comes, leaves no claim standing, and every call
goes through plain redis-py: the fast path's transport, broken on purpose, is never touched."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from daemon.job import JobState
from daemon.queue.job_queue import JobQueue
from tests.daemon.queue.test_plain_path import break_fast_transport
from tests.daemon.worker.test_look_ahead import held_until_released, marks
from tests.support.workers import note_lingers, running_worker, sh, wait_file, wait_state, wait_until


@pytest.fixture
def plain(redis: Redis) -> JobQueue:
    """A queue with the fast path off."""
    return JobQueue(redis, lease_seconds=30, fast_path=False)


@pytest.fixture
def no_fast_transport(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The fast path's transport broken on purpose (test_plain_path.py): what was called."""
    return break_fast_transport(monkeypatch)


async def test_with_the_fast_path_off_a_worker_of_short_jobs_claims_only_for_its_free_slots(
    plain: JobQueue, tmp_path: Path, no_fast_transport: list[str]
) -> None:
    """issue 46: with the switch off, a worker without GPUs whose last job was short claims nothing
    ahead of a free slot while its one slot runs a job (with it on it keeps two claimed ahead:
    test_look_ahead.py), and every call it and its queue make goes through plain redis-py."""
    short, _ = await plain.enqueue(sh("true"))
    first, _ = await plain.enqueue(sh(held_until_released(tmp_path, "first")))
    waiting = [(await plain.enqueue(sh(marks(tmp_path, f"next{n}"))))[0] for n in range(3)]
    async with running_worker(plain, tmp_path / "w", slots=1, look_ahead_hold=60):
        await wait_file(tmp_path / "first.started")
        await wait_state(plain, short, JobState.SUCCEEDED)
        await asyncio.sleep(0.5)  # with the fast path on, two are claimed ahead within a few ms
        assert [(await plain.get(j)).state for j in waiting] == [JobState.QUEUED] * 3
        (tmp_path / "first.go").touch()
        infos = [await wait_state(plain, j, JobState.SUCCEEDED) for j in (first, *waiting)]
    starts = [info.started_at or 0.0 for info in infos]
    assert starts == sorted(starts)  # FIFO all the same
    assert all([a.how for a in info.attempts] == ["succeeded"] for info in infos)
    assert no_fast_transport == []


async def test_with_the_fast_path_off_outcomes_never_linger_and_no_claim_stands(
    plain: JobQueue, tmp_path: Path, no_fast_transport: list[str]
) -> None:
    """issue 46: with the switch off, short jobs flowing on two slots record each outcome as it
    comes (no linger: with it on, some wait for company, test_look_ahead.py), and an idle
    worker's wait leaves no claim with its queue for an enqueue to send: the job enqueued then
    is claimed by the worker, woken, as a GPU worker's is."""
    lingers = note_lingers(plain)
    stood: list[object] = []
    stand = plain.stand

    def noted_stand(*args: Any, **kwargs: Any) -> Any:
        standing = stand(*args, **kwargs)
        stood.append(standing)
        return standing

    plain.stand = noted_stand  # type: ignore[method-assign]
    flow = [(await plain.enqueue(sh("true")))[0] for _ in range(20)]
    async with running_worker(plain, tmp_path / "w", slots=2) as worker:
        for job_id in flow:
            await wait_state(plain, job_id, JobState.SUCCEEDED)

        async def idle() -> bool:
            return not worker.leases()

        await wait_until(idle, timeout=15, what="every outcome recorded")
        await asyncio.sleep(0.2)  # the worker waits for work now
        late, _ = await plain.enqueue(sh("true"))
        await wait_state(plain, late, JobState.SUCCEEDED)
    assert set(lingers) == {*flow, late}
    assert set(lingers.values()) == {0.0}
    assert stood == [] or set(stood) == {None}  # asked (or not), nothing was left standing
    assert plain._standing == []
    assert no_fast_transport == []
