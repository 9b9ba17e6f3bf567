"""Dependencies (`--after JOB[:ok|:fail|:any]`, daemon/after.py, server/dependencies.py): a real
server, a real worker running real processes, a real redis-server killed with SIGKILL."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from daemon.client.pool_client import ClientError
from daemon.ctl.arrays import array_specs
from daemon.job import JobSpec, JobState, Outcome
from daemon.queue import keys
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from protocol import Enqueue, EnqueueBatch, Enqueued, EnqueuedBatch, JobDetail, ShowJob
from tests.support.faults import memory_full
from tests.support.pool import Pool, running_pool
from tests.support.workers import logs_its_span, most_at_once, running_worker, wait_state


def job(script: str, *after: str) -> dict[str, object]:
    return {"argv": ["sh", "-c", script], **({"after": list(after)} if after else {})}


async def enqueue(pool: Pool, spec: dict[str, object]) -> str:
    async with pool.client() as c:
        return (await c.call(Enqueue(spec, None), Enqueued)).job_id


async def test_a_pipeline_runs_in_order_and_a_branch_that_can_never_run_is_cancelled(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    async with running_pool(redis_server, tmp_path) as pool:
        train = await enqueue(pool, job(f"while [ ! -e {go} ]; do sleep 0.02; done"))
        evaluate = await enqueue(pool, job("true", train))  # :ok, the default
        report = await enqueue(pool, job("true", f"{evaluate}:ok"))
        on_failure = await enqueue(pool, job("true", f"{train}:fail"))
        cleanup = await enqueue(pool, job("true", f"{train}:any"))
        async with pool.client() as c:
            detail = (await c.call(ShowJob(evaluate), JobDetail)).job
        assert detail["pending_reason"] == f"waiting for {train} to succeed (it is queued)"
        listed = [j.id for j in await pool.queue.list_jobs()]  # held jobs are listed, last
        assert listed == [train, evaluate, report, on_failure, cleanup]
        async with running_worker(pool.queue, tmp_path / "w", slots=2):
            await wait_state(pool.queue, train, JobState.RUNNING)
            assert (await pool.queue.get(evaluate)).state is JobState.QUEUED  # held, not claimed
            go.touch()
            for done in (train, evaluate, report, cleanup):
                await wait_state(pool.queue, done, JobState.SUCCEEDED)
            never = await wait_state(pool.queue, on_failure, JobState.CANCELLED)
        assert never.detail == f"cancelled: the job it waited for, {train}, succeeded (it waited for :fail)"
        for first, then in ((train, evaluate), (evaluate, report)):
            a, b = await pool.queue.get(first), await pool.queue.get(then)
            assert a.attempts[-1].ended_at is not None
            assert b.attempts[0].started_at >= a.attempts[-1].ended_at


async def test_a_cancelled_dependency_cancels_the_chain_behind_it(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    async with running_pool(redis_server, tmp_path) as pool:
        first = await enqueue(pool, job("true"))
        second = await enqueue(pool, job("true", first))
        third = await enqueue(pool, job("true", second))
        assert await pool.queue.cancel(first) == "cancelled"
        gone = await wait_state(pool.queue, third, JobState.CANCELLED)
        assert gone.detail == f"cancelled: the job it waited for, {second}, cancelled (it waited for :ok)"
        assert await pool.queue.waiting("default") == []


async def test_an_unknown_or_malformed_dependency_is_refused_and_nothing_is_queued(pool: Pool) -> None:
    async with pool.client() as c:
        with pytest.raises(ClientError, match=r"--after default\.zzzzzzzz1: no such job in the pool"):
            await c.call(Enqueue(job("true", "default.zzzzzzzz1"), None), Enqueued)
        with pytest.raises(ClientError, match="is not a job id with an optional :ok, :fail or :any"):
            await c.call(Enqueue(job("true", "default.zzzzzzzz1:maybe"), None), Enqueued)
    assert await pool.queue.list_jobs() == []


async def test_a_chain_survives_a_server_restart_and_a_redis_sigkill(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """The first link ends while no server runs (nobody sees its event): the next server judges
    every waiting job at its start. Then Redis is killed with SIGKILL and restarted on its AOF
    while the second runs: the third still runs once the second ends."""
    go, go2 = tmp_path / "go", tmp_path / "go2"
    for server_dir in ("one", "two"):
        (tmp_path / server_dir).mkdir()
    client = redis_server.client()
    queue = JobQueue(client, lease_seconds=5)
    try:
        async with running_worker(queue, tmp_path / "w", slots=2):
            async with running_pool(redis_server, tmp_path / "one") as pool:
                first = await enqueue(pool, job(f"while [ ! -e {go} ]; do sleep 0.02; done"))
                second = await enqueue(pool, job(f"while [ ! -e {go2} ]; do sleep 0.02; done", first))
                third = await enqueue(pool, job("true", second))
                await wait_state(queue, first, JobState.RUNNING)
            go.touch()  # the first ends with no server to see it
            await wait_state(queue, first, JobState.SUCCEEDED)
            assert (await queue.get(second)).state is JobState.QUEUED
            async with running_pool(redis_server, tmp_path / "two"):  # judges every waiting job
                await wait_state(queue, second, JobState.RUNNING)
                await asyncio.sleep(1.2)  # the AOF is fsynced every second: all of it is on disk
                redis_server.kill()
                redis_server.start()
                go2.touch()
                await wait_state(queue, third, JobState.SUCCEEDED, timeout=60)
    finally:
        await client.aclose()


def _array(n: int, limit: int, script: str, **extra: object) -> list[JobSpec]:
    """An array's jobs as poolctl sends them, as the server takes them (user alice)."""
    _, specs = array_specs({"argv": ["sh", "-c", script], **extra}, list(range(n)), [], limit)
    return [JobSpec.from_dict({**s, "user": "alice"}) for s in specs]


async def test_jobs_whose_server_died_right_after_their_enqueue_still_run(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 43 item 1: the enqueue script is all that reached Redis (the server was SIGKILLed
    before it could record what the jobs wait for, or judge them): a dependent and a %3 array
    still run, in order and within the window, once a server runs again, and the array's id
    names all of its jobs."""
    log = tmp_path / "log"
    queue = JobQueue(redis_server.client(), lease_seconds=5)
    try:
        first = (await queue.enqueue(JobSpec(argv=("true",), user="alice")))[0]
        dependent, _ = await queue.enqueue(JobSpec(argv=("true",), user="alice", after=(f"{first}:ok",)))
        jobs = _array(12, 3, logs_its_span(log))
        ids = await queue.enqueue_many(jobs)  # and nothing after: the server died here
        assert await queue.array_jobs(jobs[0].array) == ids
        async with (
            running_pool(redis_server, tmp_path, worker_healthy_response_period=5.0),
            running_worker(queue, tmp_path / "w", slots=8),
        ):
            await wait_state(queue, dependent, JobState.SUCCEEDED)
            infos = [await wait_state(queue, job_id, JobState.SUCCEEDED) for job_id in ids]
    finally:
        await queue.redis.aclose()
    assert 1 <= most_at_once(log.read_text().splitlines()) <= 3
    starts = [info.started_at or 0 for info in infos]  # let in, and so claimed, by index
    assert starts == sorted(starts)


async def test_a_judge_redis_refused_is_made_again(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    """issue 43 item 2: the job a dependent waits for ends while Redis is at its maxmemory, so
    the judge that would let the dependent into its queue is refused; once Redis has room, the
    dependent runs, without a server restart or another end to set it off."""
    go = tmp_path / "go"
    async with running_pool(redis_server, tmp_path, worker_healthy_response_period=5.0) as pool:
        first = await enqueue(pool, job(f"while [ ! -e {go} ]; do sleep 0.02; done"))
        second = await enqueue(pool, job("true", first))
        async with running_worker(pool.queue, tmp_path / "w", slots=2):
            await wait_state(pool.queue, first, JobState.RUNNING)
            async with memory_full(redis_server):
                go.touch()
                await wait_state(pool.queue, first, JobState.SUCCEEDED)
                await asyncio.sleep(1.0)  # the end's event is read, and its judge refused
                assert (await pool.queue.get(second)).state is JobState.QUEUED
            await wait_state(pool.queue, second, JobState.SUCCEEDED, timeout=20)


async def test_what_waiting_jobs_need_lives_as_long_as_they_wait(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 43 item 4: a dependency's `dependents` set and an array's record outlive twice the
    retention while their jobs still wait (they once expired then, 2 x job_retention after the
    enqueue), and expire with the retention once the jobs have ended."""
    go = tmp_path / "go"
    hold = f"while [ ! -e {go} ]; do sleep 0.02; done"
    async with running_pool(redis_server, tmp_path, job_retention=1.0) as pool:
        first = await enqueue(pool, job(hold))
        second = await enqueue(pool, job("true", first))
        jobs = [{k: v for k, v in s.to_dict().items() if k != "user"} for s in _array(3, 1, hold)]
        async with pool.client() as c:
            ids = (await c.call(EnqueueBatch(jobs), EnqueuedBatch)).job_ids
        array_id = jobs[0]["array"]
        await asyncio.sleep(2.5)  # past twice the retention
        assert await pool.queue.dependents(first) == [second]
        assert await pool.queue.array_jobs(array_id) == ids
        async with running_worker(pool.queue, tmp_path / "w", slots=4):
            go.touch()
            for job_id in (first, second, *ids):
                await wait_state(pool.queue, job_id, JobState.SUCCEEDED)
        client = pool.queue.redis
        assert 0 < await client.ttl(keys.dependents(first)) <= 1
        for key in (keys.array(array_id), keys.array_left(array_id)):
            assert 0 < await client.ttl(key) <= 1
        assert not await client.exists(keys.array_active(array_id), keys.array_next(array_id))


async def test_a_dependency_met_stays_met_when_its_job_is_forgotten(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 43 (nothing a live job needs expires while it lives): a job waiting for A and B, with
    A succeeded, judged, and then forgotten (past job_retention while B still ran) was cancelled
    by the next judge as waiting for a job "not in the pool"; what a judge found met is kept on
    the waiting job's record now, so it runs once B succeeds."""
    async with running_pool(redis_server, tmp_path, worker_healthy_response_period=5.0) as pool:
        a = await enqueue(pool, job("true"))
        b = await enqueue(pool, job("true"))
        both = await enqueue(pool, job("true", a, b))
        for expected in (a, b):
            lease = await pool.queue.claim("stand-in", ["default"])
            assert lease is not None
            assert lease.job_id == expected
            await pool.queue.complete(lease, Outcome(JobState.SUCCEEDED, exit_code=0))
            if expected == a:
                await asyncio.sleep(2.0)  # a sweep judges `both`: A met, B not yet
                assert (await pool.queue.get(both)).state is JobState.QUEUED
                await pool.queue.redis.delete(keys.job(a))  # A past its retention
                await asyncio.sleep(2.0)  # and another sweep
                assert (await pool.queue.get(both)).state is JobState.QUEUED
        async with running_worker(pool.queue, tmp_path / "w"):
            await wait_state(pool.queue, both, JobState.SUCCEEDED)
