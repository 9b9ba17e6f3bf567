"""The worker under the faults a review found (issue 12), each with a real redis-server and real
processes: an idle Redis, a Redis that answers late, a Redis that restarts, a Redis at its memory
limit. Each test's docstring names the item it covers."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from daemon.job import JobState, Lease
from daemon.queue import keys
from daemon.queue.connection import RunIdWatch, connect
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.worker.dispatcher import Worker
from daemon.worker.gpus import GpuInfo
from daemon.worker.run_types import Run
from tests.support.faults import aof_copy, memory_full, roll_back
from tests.support.proxy import Proxy
from tests.support.workers import alive, running_worker, sh, wait_dead, wait_file, wait_state, wait_until


async def test_an_idle_worker_keeps_waiting_without_timeouts(
    redis_server: EmbeddedRedis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Item 1: a worker waiting for work blocked in XREAD for as long as the client's socket
    timeout, so on a healthy, idle Redis its reads timed out, were retried by redis-py, and ended in
    "claiming failed (Timeout reading ...)" with a growing back-off. Here the client's timeout is
    short, so the idle wait outlasts it many times over; a job enqueued afterwards still starts."""
    client = redis_server.client(socket_timeout=0.2)
    queue = JobQueue(client, lease_seconds=30)
    try:
        with caplog.at_level(logging.WARNING):
            async with running_worker(queue, tmp_path / "w"):
                await asyncio.sleep(3)  # many socket timeouts over
                job_id, _ = await queue.enqueue(sh("true"))
                await wait_state(queue, job_id, JobState.SUCCEEDED, timeout=10)
    finally:
        await client.aclose()
    assert not [r for r in caplog.records if "failed" in r.getMessage()], caplog.text
    # and the wait itself, however long it is asked to block, ends before the socket timeout
    client = redis_server.client(socket_timeout=0.2)
    try:
        assert await JobQueue(client).wait_for_work(["default"], block=5) == []
    finally:
        await client.aclose()


@pytest.mark.both_paths
async def test_at_maxmemory_a_worker_claims_nothing_and_keeps_what_it_runs(
    redis_server: EmbeddedRedis, queue: JobQueue, tmp_path: Path, fast_path: bool
) -> None:
    """Item 2: with Redis at maxmemory its heartbeats were refused but its claims were not: the
    worker fenced its running job, then claimed the next one, which ran unrenewed and unfenced
    until the reaper gave it to another worker while it still ran. Now a worker whose heartbeat is
    refused claims nothing, and its running jobs keep their leases (renewing takes no memory)."""
    short = JobQueue(queue.redis, lease_seconds=1.5, fast_path=fast_path)
    await short.enqueue(sh(f"echo $$ > {tmp_path / 'a'}; exec sleep 60"))
    ending, _ = await short.enqueue(sh(f"touch {tmp_path / 'c'}; sleep 1"))  # frees a slot at maxmemory
    behind, _ = await short.enqueue(sh(f"echo $$ > {tmp_path / 'b'}; exec sleep 60"))
    async with running_worker(short, tmp_path / "w", slots=2):
        first = int((await wait_file(tmp_path / "a"))[0])
        await wait_file(tmp_path / "c", lines=0)
        async with memory_full(redis_server):
            await wait_state(short, ending, JobState.SUCCEEDED)  # an outcome goes through
            await asyncio.sleep(3)  # two leases: time enough to claim, or to lose a lease
            assert not (tmp_path / "b").exists()
            assert alive(first)
        await wait_file(tmp_path / "b")  # Redis has room again: the next job runs
        assert (await short.get(behind)).attempt == 1
        assert alive(first)


@pytest.mark.both_paths
async def test_a_late_lost_answer_for_one_attempt_leaves_the_next_attempt_alone(
    redis_server: EmbeddedRedis, queue: JobQueue, tmp_path: Path, fast_path: bool
) -> None:
    """Item 3: renewal answers were keyed by job id, so a LOST meant for attempt 1, arriving late,
    killed attempt 2 of the same job on the same worker, which then stayed `running` in Redis
    with a lease nobody renewed. The reply is held back for real, in a proxy, until attempt 2
    runs."""
    marker = tmp_path / "attempts"
    script = (
        f'echo "$GPUPOOL_ATTEMPT" >> {marker}; if [ "$GPUPOOL_ATTEMPT" = 1 ]; then exec sleep 60; fi; sleep 1'
    )
    job_id, _ = await queue.enqueue(sh(script))
    proxy = Proxy(redis_server.port)
    await proxy.start()
    client = connect("127.0.0.1", proxy.port, password=redis_server.password)
    through = JobQueue(client, lease_seconds=60, fast_path=fast_path)
    try:
        async with running_worker(through, tmp_path / "w", slots=2, heartbeat_seconds=30) as worker:
            await wait_file(marker)
            renew = through.scripts.renew.sha.encode()
            proxy.hold_request(lambda request: renew in request)
            worker.heartbeat.poke()  # a renewal of attempt 1, held back on its way
            await wait_until(lambda: _upheld(proxy), what="the renewal to be held")
            await queue.redis.zadd(keys.leases("default"), {job_id: 0})
            assert await queue.reclaim(["default"]) == [(job_id, JobState.QUEUED)]
            await wait_file(marker, lines=2)  # the worker claimed the job again: attempt 2 runs
            proxy.send_held()  # the renewal arrives now, and its answer for attempt 1 is LOST
            info = await wait_state(queue, job_id, JobState.SUCCEEDED, timeout=20)
    finally:
        await client.aclose()
        await proxy.stop()
    assert [(a.attempt, a.how) for a in info.attempts] == [(1, "lost"), (2, "succeeded")]


async def _upheld(proxy: Proxy) -> bool:
    return any(link.upheld for link in proxy.links)


@pytest.mark.both_paths
async def test_a_redis_restart_makes_the_worker_revalidate_its_leases_at_once(
    redis_server: EmbeddedRedis, tmp_path: Path, fast_path: bool
) -> None:
    """Item 4: after Redis restarted having lost its last writes (here: from an AOF copied before
    the claim), a worker ran on an attempt Redis no longer knew of until its next heartbeat, a
    tenth of a lease later, while any worker could claim the job again. Now it notices the new
    Redis (its run id) on reconnecting and re-validates its leases at once."""
    watch = RunIdWatch()
    client = redis_server.client(watch=watch)
    queue = JobQueue(client, lease_seconds=120, watch=watch, fast_path=fast_path)
    await queue.enqueue(sh(f"echo $$ > {tmp_path / 'pid'}; exec sleep 120"))
    before = aof_copy(redis_server)
    try:
        async with running_worker(queue, tmp_path / "w", heartbeat_seconds=30):
            pid = int((await wait_file(tmp_path / "pid"))[0])
            roll_back(redis_server, before)  # the claim is forgotten
            await wait_dead([pid], timeout=10)  # not 30 s later, at the next heartbeat
    finally:
        await client.aclose()


async def test_an_outcome_reached_while_redis_is_away_is_recorded_when_it_returns(
    redis_server: EmbeddedRedis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Item 9: when Redis was away longer than the self-fence, the worker logged "killing 2 running
    jobs" even for jobs that had exited 0, gave up recording, and the job ran again. An attempt
    whose process ended offers its outcome until Redis answers; the fenced complete decides."""
    client = redis_server.client()
    queue = JobQueue(client, lease_seconds=1.5)
    job_id, _ = await queue.enqueue(sh(f"touch {tmp_path / 'started'}; sleep 0.5; touch {tmp_path / 'done'}"))
    try:
        with caplog.at_level(logging.INFO):
            async with running_worker(queue, tmp_path / "w"):
                await wait_file(tmp_path / "started", lines=0)
                redis_server.kill()
                try:
                    await wait_file(tmp_path / "done", lines=0)
                    await asyncio.sleep(8)  # past the lease, and past redis-py's own retries
                finally:
                    redis_server.start()
                info = await wait_state(queue, job_id, JobState.SUCCEEDED, timeout=20)
    finally:
        await client.aclose()
    assert [a.how for a in info.attempts] == ["succeeded"]
    assert "killing" not in caplog.text


@pytest.mark.both_paths
async def test_a_job_whose_claim_is_answered_after_its_deadline_never_starts(
    redis_server: EmbeddedRedis, queue: JobQueue, tmp_path: Path, fast_path: bool
) -> None:
    """Issue 43, found by the chaos suite (its workflow run, seed 19: one worker's replies came
    late): a claim answered after the worker's own deadline for its lease started the job all the
    same, and the job ran on past its lease in Redis while another worker ran it again. Here the
    claim is held back on its way to Redis for longer than the lease, so that its answer comes
    after that deadline: the job must not start under it (no process), and runs once reclaimed."""
    marker = tmp_path / "attempts"
    proxy = Proxy(redis_server.port)
    await proxy.start()
    client = connect("127.0.0.1", proxy.port, password=redis_server.password)
    through = JobQueue(client, lease_seconds=1.0, fast_path=fast_path)
    runs: dict[tuple[str, int], Run] = {}  # (job, attempt) -> its run
    workers: list[Worker] = []

    def make_run(lease: Lease, gpus: tuple[GpuInfo, ...], slot: int) -> Run:
        runs[lease.job_id, lease.attempt] = run = workers[0]._job_run(lease, gpus, slot)
        return run

    try:
        async with running_worker(through, tmp_path / "w", make_run=make_run) as worker:
            workers.append(worker)
            first, _ = await queue.enqueue(sh("true"))  # after it, the slot is ready: a start spawns at once
            await wait_state(queue, first, JobState.SUCCEEDED)
            claim = through.scripts.claim.sha.encode()
            proxy.hold_request(lambda request: claim in request)
            job_id, _ = await queue.enqueue(sh(f'echo "$GPUPOOL_ATTEMPT" >> {marker}'))
            await wait_until(lambda: _upheld(proxy), what="the claim to be held")
            await asyncio.sleep(1.2)  # longer than the lease: the deadline passes before the answer
            proxy.send_held()
            await wait_until(lambda: _has(runs, (job_id, 1)), what="the answer to the claim")
            assert runs[job_id, 1].pid is None  # type: ignore[attr-defined]
            await wait_until(lambda: _lapsed(queue, job_id), what="attempt 1's lease to lapse in Redis")
            assert await queue.reclaim(["default"]) == [(job_id, JobState.QUEUED)]
            info = await wait_state(queue, job_id, JobState.SUCCEEDED, timeout=20)
    finally:
        await client.aclose()
        await proxy.stop()
    assert marker.read_text().split() == ["2"]
    assert [a.how for a in info.attempts] == ["lost", "succeeded"]


async def _has(runs: dict[tuple[str, int], Run], key: tuple[str, int]) -> bool:
    return key in runs


async def _lapsed(queue: JobQueue, job_id: str) -> bool:
    deadline = await queue.redis.zscore(keys.leases("default"), job_id)
    seconds, micros = await queue.redis.time()
    return deadline is not None and deadline < seconds * 1000 + micros / 1000
