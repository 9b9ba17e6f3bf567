"""CPUs and memory as resources at the server (issue 50): `poolctl enqueue --cpus N --mem SIZE`,
a queue's defaults, a job no worker could hold refused at enqueue as one of too many GPUs is,
and a live worker fitting what it holds. A real server, a real worker, poolctl a subprocess."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgpack
import pytest

from daemon.client.pool_client import ClientError
from daemon.job import JobState
from daemon.queue import keys
from daemon.queue.claims import Capacity
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.registry import Registration
from daemon.worker.host import HostResources
from protocol import CancelJobs, Cancelled, Enqueue, Enqueued, ErrorCode, JobDetail, ShowJob, Waited, WaitJobs
from tests.support.pool import running_pool
from tests.support.poolctl import poolctl
from tests.support.workers import running_worker, wait_state

GIB = 2**30


async def test_cpus_and_mem_are_asked_defaulted_refused_and_fitted(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 50: `poolctl enqueue --cpus 4` on a pool whose workers have 2 CPUs for jobs is
    refused at enqueue, saying why and what to do (exit 2, as for GPUs), and so is `--mem` past
    every worker's memory (queued with --wait-for-worker, `show` says why it waits); a job asking
    for none gets its queue's default (queue_default_cpus); and the worker fits what it holds: a
    1-CPU job waits while a 2-CPU job holds both CPUs, and starts once it ends."""
    host = HostResources(cpus=2, mem=GIB)
    async with (
        running_pool(redis_server, tmp_path, queue_default_cpus=["default=1"]) as pool,
        running_worker(pool.queue, tmp_path / "w", slots=3, host=host),
        pool.client() as c,
    ):
        code, _, err = await poolctl(pool.env(), "enqueue", "--cpus", "4", "--mem", "512M", "--", "true")
        assert code == 2
        assert "needs 4 CPUs; the largest worker serving queue 'default' has 2 CPUs for jobs." in err
        assert "--wait-for-worker" in err
        with pytest.raises(ClientError) as refused:
            await c.call(Enqueue({"argv": ["true"], "mem": 2 * GIB}, None), Enqueued)
        assert refused.value.code == ErrorCode.INVALID_ARGUMENT
        assert str(refused.value).startswith("needs 2.0 GiB of memory; the largest worker serving")
        code, out, err = await poolctl(
            pool.env(), "enqueue", "--cpus", "2", "--mem", "256M", "--json", "--", "sleep", "60"
        )
        assert code == 0, err
        big = json.loads(out)["id"]
        await wait_state(pool.queue, big, JobState.RUNNING)
        small = (await c.call(Enqueue({"argv": ["true"]}, None), Enqueued)).job_id
        detail = (await c.call(ShowJob(small), JobDetail)).job
        assert detail["spec"]["cpus"] == 1  # the queue's default, filled in at enqueue
        assert detail["state"] == "queued"  # both CPUs are the big job's
        assert (await c.call(ShowJob(big), JobDetail)).job["spec"]["mem"] == 256 * 2**20
        waits = await c.call(Enqueue({"argv": ["true"], "cpus": 4, "wait_for_worker": True}, None), Enqueued)
        reason = (await c.call(ShowJob(waits.job_id), JobDetail)).job["pending_reason"]
        assert reason.startswith("needs 4 CPUs, and no live worker has that many for jobs")
        await c.call(CancelJobs([big, waits.job_id]), Cancelled)
        done = await c.call(WaitJobs([small], 30), Waited)
        assert [j["state"] for j in done.jobs] == ["succeeded"]


async def test_a_queue_an_older_worker_serves_gets_no_cpus_or_memory_in_its_specs(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 50, a review's finding: in a rolling upgrade a worker of before issue 50 refuses a
    spec with `cpus` or `mem` (unknown fields) and fails the job: every job of a queue with a
    default failed on every worker not upgraded yet. While such a worker serves the queue (its
    registration has no `job_memory`), the server fills in no default there and refuses a job
    that asks, saying to upgrade the queue's workers first."""
    async with (
        running_pool(redis_server, tmp_path, queue_default_cpus=["default=1"]) as pool,
        pool.client() as c,
    ):
        older = Registration(id="w-older", slots=1, queues=("default",), healthy_period=300).to_dict()
        del older["job_memory"]  # as a worker of before issue 50 registers
        async with pool.queue.redis.pipeline(transaction=False) as pipe:
            pipe.hset(keys.WORKERS, "w-older", msgpack.packb(older))
            pipe.zadd(keys.WORKERS_SEEN, {"w-older": time.time() * 1000})
            await pipe.execute()
        plain = (await c.call(Enqueue({"argv": ["true"]}, None), Enqueued)).job_id
        assert "cpus" not in (await c.call(ShowJob(plain), JobDetail)).job["spec"]  # no default
        with pytest.raises(ClientError) as refused:
            await c.call(Enqueue({"argv": ["true"], "cpus": 1}, None), Enqueued)
        assert refused.value.code == ErrorCode.INVALID_ARGUMENT
        assert "w-older" in str(refused.value)
        assert "upgrade" in str(refused.value)
        await c.call(CancelJobs([plain]), Cancelled)


async def test_a_job_is_refused_unless_one_worker_has_all_it_needs(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 50, a review's finding: admission compared a job's CPUs with the most CPUs of any
    worker and its memory with the most memory of any, so a job needing 64 CPUs and 256 GiB was
    queued where one worker has the CPUs and another the memory: parked for ever. One worker
    must have all of it."""
    async with running_pool(redis_server, tmp_path) as pool, pool.client() as c:
        for name, cpus, memory in (("w-many-cpus", 64, 8 * GIB), ("w-much-memory", 2, 512 * GIB)):
            worker = Registration(id=name, slots=1, queues=("big",), healthy_period=300)
            worker.cpus, worker.job_memory = cpus, memory
            async with pool.queue.redis.pipeline(transaction=False) as pipe:
                pipe.hset(keys.WORKERS, name, msgpack.packb(worker.to_dict()))
                pipe.zadd(keys.WORKERS_SEEN, {name: time.time() * 1000})
                await pipe.execute()
        with pytest.raises(ClientError) as refused:
            await c.call(
                Enqueue({"argv": ["true"], "queue": "big", "cpus": 64, "mem": 256 * GIB}, None), Enqueued
            )
        assert refused.value.code == ErrorCode.INVALID_ARGUMENT
        assert "on one worker" in str(refused.value), refused.value
        fits = {"argv": ["true"], "queue": "big", "cpus": 64, "mem": 8 * GIB}
        job_id = (await c.call(Enqueue(fits, None), Enqueued)).job_id  # the first worker holds it
        await c.call(CancelJobs([job_id]), Cancelled)


async def test_a_job_needs_its_gpus_on_the_worker_that_has_its_cpus(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 50, a review's finding (one worker must fit a job whole): the one-worker check left
    GPUs out for a job sharing a GPU (--gpu-mem), so 32 CPUs on a worker with no GPU and 40 GiB on
    another's GPU were taken together: parked for ever. And a job asking for more GPUs than any
    worker has hears that, not that no worker has "them all"."""
    async with running_pool(redis_server, tmp_path) as pool, pool.client() as c:
        one_gpu: list[dict[str, int]] = [{"index": 0, "memory": 80 * GIB}]
        for name, cpus, gpus in (("w-cpus-only", 64, []), ("w-one-gpu", 4, one_gpu)):
            worker = Registration(id=name, slots=1, queues=("mixed",), healthy_period=300, gpus=gpus)
            worker.cpus, worker.job_memory = cpus, 64 * GIB
            async with pool.queue.redis.pipeline(transaction=False) as pipe:
                pipe.hset(keys.WORKERS, name, msgpack.packb(worker.to_dict()))
                pipe.zadd(keys.WORKERS_SEEN, {name: time.time() * 1000})
                await pipe.execute()
        shared = {"argv": ["true"], "queue": "mixed", "cpus": 32, "gpu_mem": 40 * GIB}
        with pytest.raises(ClientError) as refused:
            await c.call(Enqueue(shared, None), Enqueued)
        assert "on one worker" in str(refused.value), refused.value
        whole = {"argv": ["true"], "queue": "mixed", "cpus": 1, "gpus": 2}
        with pytest.raises(ClientError) as refused:
            await c.call(Enqueue(whole, None), Enqueued)
        assert "needs 2 GPUs; the largest worker serving queue 'mixed' has 1" in str(refused.value)
        fits = (await c.call(Enqueue({**shared, "cpus": 4}, None), Enqueued)).job_id  # w-one-gpu's
        await c.call(CancelJobs([fits]), Cancelled)


async def test_show_says_no_worker_can_hold_a_job_whose_cpus_and_memory_no_one_worker_has(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 50 review: `poolctl show` judged a job by a worker with the most CPUs of one live
    worker and the most memory of another, so a job needing 16 CPUs and 60 GiB, where one worker
    has 16 CPUs and 8 GiB and the other 2 CPUs and 64 GiB, was said to be next to start: it never
    would. It is said to need them on one worker, as admission (the same check) refuses it; a job
    one of them holds is not."""
    async with running_pool(redis_server, tmp_path) as pool, pool.client() as c:
        for name, cpus, memory in (("w-cpus", 16, 8 * GIB), ("w-memory", 2, 64 * GIB)):
            worker = Registration(id=name, slots=1, queues=("big",), healthy_period=300)
            worker.cpus, worker.job_memory = cpus, memory
            async with pool.queue.redis.pipeline(transaction=False) as pipe:
                pipe.hset(keys.WORKERS, name, msgpack.packb(worker.to_dict()))
                pipe.zadd(keys.WORKERS_SEEN, {name: time.time() * 1000})
                await pipe.execute()
        both = {"argv": ["true"], "queue": "big", "cpus": 16, "mem": 60 * GIB, "wait_for_worker": True}
        never = (await c.call(Enqueue(both, None), Enqueued)).job_id
        fits = (await c.call(Enqueue({**both, "mem": 8 * GIB}, None), Enqueued)).job_id
        reason = (await c.call(ShowJob(never), JobDetail)).job["pending_reason"]
        assert reason.startswith(
            "needs 16 CPUs and 60.0 GiB of memory on one worker, and no live worker serving queue "
            "'big' has them all"
        ), reason
        assert (await c.call(ShowJob(fits), JobDetail)).job["pending_reason"] == (
            "1 job(s) ahead of it in queue 'big'"
        )
        await c.call(CancelJobs([never, fits]), Cancelled)


async def test_show_says_what_a_head_reserved_on_a_worker_waits_for(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 50 review: a head reserved on a worker was said to be "waiting for its GPUs" when it
    needs none and waits for CPUs (2 of the worker's 4 held for 10 minutes at most): `show` says
    what it waits for."""
    async with running_pool(redis_server, tmp_path) as pool, pool.client() as c:
        head = (
            await c.call(Enqueue({"argv": ["true"], "cpus": 4, "wait_for_worker": True}, None), Enqueued)
        ).job_id
        room = Capacity(cpus_free=2, cpus_total=4, mem_free=GIB, mem_total=GIB, host_ends=[(600.0, 2, 0)])
        assert await pool.queue.claim_many("w1", ["default"], 1, room) == []  # as the worker would
        reason = (await c.call(ShowJob(head), JobDetail)).job["pending_reason"]
        assert reason.startswith("waiting for 4 CPUs; reserved on w1, expected by "), reason
        await c.call(CancelJobs([head]), Cancelled)
