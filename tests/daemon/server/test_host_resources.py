"""CPUs and memory as resources at the server (issue 50): `poolctl enqueue --cpus N --mem SIZE`,
a queue's defaults, a job no worker could hold refused at enqueue as one of too many GPUs is,
and a live worker fitting what it holds. A real server, a real worker, poolctl a subprocess."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from daemon.client.pool_client import ClientError
from daemon.job import JobState
from daemon.queue.embedded_redis import EmbeddedRedis
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
