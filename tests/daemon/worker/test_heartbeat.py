"""Heartbeats and leases (worker/heartbeat.py, queue/registry.py) against a real redis-server."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Connection, ConnectionPool, Redis

from daemon.job import JobSpec, JobState, Lease, RenewStatus
from daemon.queue import keys
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.queue.registry import Registration, list_workers
from daemon.worker.dispatcher import Worker
from daemon.worker.heartbeat import Heartbeat
from tests.support.workers import alive, running_worker, wait_dead, wait_file, wait_state, wait_until


class CountingConnection(Connection):
    """Counts writes to the socket: a pipeline is one write, so writes = round trips."""

    writes = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.writes += 1
        await super().send_packed_command(command, check_health)


class Target:
    """A stand-in worker holding some leases."""

    def __init__(self, worker: str, leases: Sequence[Lease]) -> None:
        self.reg = Registration(id=worker, slots=len(leases), queues=["default"], healthy_period=30)
        self.held = list(leases)
        self.statuses: list[Mapping[str, RenewStatus]] = []

    def registration(self) -> Registration:
        return self.reg

    def leases(self) -> Sequence[Lease]:
        return self.held

    def renewed(self, statuses: Mapping[str, RenewStatus], until: float) -> None:
        self.statuses.append(statuses)


# What heartbeat.lua and renew.lua call inside Redis: commandstats counts those calls too (SADD:
# the heartbeat names the worker's queues in the pool's queue set).
IN_SCRIPTS = {
    "cmdstat_time",
    "cmdstat_hset",
    "cmdstat_zadd",
    "cmdstat_hmget",
    "cmdstat_zscore",
    "cmdstat_sadd",
    "cmdstat_zrem",  # renew's first write, a deletion of nothing: at maxmemory renewals go through
}


async def commands(redis: Redis) -> dict[str, int]:
    stats = await redis.info("commandstats")
    return {name: int(v["calls"]) for name, v in stats.items() if name != "cmdstat_info"}


async def test_one_round_trip_per_heartbeat_whatever_the_number_of_jobs(
    redis_server: EmbeddedRedis, redis: Redis
) -> None:
    pool = ConnectionPool(
        connection_class=CountingConnection,
        host="127.0.0.1",
        port=redis_server.port,
        password=redis_server.password,
    )
    counted = Redis.from_pool(pool)  # owns the pool: aclose() closes its connections
    try:
        per_beat = await _measure(counted, redis)
    finally:
        await counted.aclose()
    for (_, n_other), (writes, delta) in per_beat.items():
        assert writes == 3  # one round trip per heartbeat
        queues = 2 if n_other else 1
        # per heartbeat: one heartbeat script, one renew script per queue, and no other command
        assert delta["cmdstat_evalsha"] == 3 * (1 + queues)
        assert set(delta) - IN_SCRIPTS == {"cmdstat_evalsha"}, delta


async def _measure(counted: Redis, redis: Redis) -> dict[tuple[int, int], tuple[int, dict[str, int]]]:
    queue = JobQueue(counted, lease_seconds=30)
    await queue.enqueue_many([JobSpec(argv=("true",)) for _ in range(20)])
    await queue.enqueue_many([JobSpec(argv=("true",), queue="other") for _ in range(20)])
    leases = [await queue.claim("w1", ["default"]) for _ in range(20)]
    leases += [await queue.claim("w1", ["other"]) for _ in range(20)]
    held = [lease for lease in leases if lease is not None]

    per_beat: dict[tuple[int, int], tuple[int, dict[str, int]]] = {}
    for n_default, n_other in [(1, 0), (20, 0), (1, 1), (20, 20)]:
        target = Target("w1", held[:n_default] + held[20 : 20 + n_other])
        beat = Heartbeat(queue, target, interval=1.0)
        await beat.beat()  # warm: a connection in the pool, the scripts loaded
        before, writes = await commands(redis), CountingConnection.writes
        for _ in range(3):
            statuses = await beat.beat()
            assert set(statuses.values()) == {RenewStatus.OK}
            assert len(statuses) == n_default + n_other
        after = await commands(redis)
        delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        per_beat[(n_default, n_other)] = (CountingConnection.writes - writes, delta)
    return per_beat


async def test_heartbeat_registers_with_redis_time_and_dead_workers_show_dead(redis: Redis) -> None:
    queue = JobQueue(redis, lease_seconds=30)
    target = Target("host-1-abc", [])
    await Heartbeat(queue, target, interval=1.0).beat()
    [record] = await list_workers(redis)
    assert (record["id"], record["health"], record["healthy_period"]) == ("host-1-abc", "healthy", 30)
    assert 0 <= record["last_heartbeat_age"] < 30
    await redis.zadd(keys.WORKERS_SEEN, {"host-1-abc": 1000})  # silent since 1970
    [record] = await list_workers(redis)
    assert record["health"] == "dead"


async def test_heartbeat_survives_a_flushed_script_cache(redis: Redis) -> None:
    queue = JobQueue(redis, lease_seconds=30)
    await queue.enqueue(JobSpec(argv=("true",)))
    lease = await queue.claim("w1", ["default"])
    assert lease is not None
    beat = Heartbeat(queue, Target("w1", [lease]), interval=1.0)
    assert await beat.beat() == {lease.id: RenewStatus.OK}
    await redis.script_flush()  # as after a Redis restart
    assert await beat.beat() == {lease.id: RenewStatus.OK}


@pytest.mark.parametrize("slots", [1, 2])
async def test_a_lease_lost_on_heartbeat_makes_the_worker_kill_the_job(
    queue: JobQueue, redis: Redis, tmp_path: Path, slots: int
) -> None:
    job_id, _ = await queue.enqueue(
        JobSpec(argv=("sh", "-c", "echo $$ >> pids; exec sleep 300"), cwd=str(tmp_path))
    )
    # With one slot the worker cannot claim the job again before attempt 1 is gone, so only the
    # heartbeat's LOST can end attempt 1; with two, claiming attempt 2 may end it first.
    async with running_worker(queue, tmp_path / "w", slots=slots) as worker:
        [first] = await wait_file(tmp_path / "pids")
        await redis.zadd(keys.leases("default"), {job_id: 0})  # the reaper presumed it dead
        assert await queue.reclaim() == [(job_id, JobState.QUEUED)]
        # Told that attempt 1 is not its own any more, the worker kills it, and claims the job
        # again (front of the queue) as attempt 2.
        await wait_dead([int(first)])
        await wait_file(tmp_path / "pids", lines=2)
        info = await queue.get(job_id)
        assert (info.attempt, [a.how for a in info.attempts]) == (2, ["lost", "running"])
        assert list(worker.running) == [job_id]
        assert worker.running[job_id].attempt == 2


async def test_a_worker_cut_off_from_redis_kills_its_jobs_before_its_lease_ends(
    redis_server: EmbeddedRedis, redis: Redis, tmp_path: Path
) -> None:
    queue = JobQueue(redis, lease_seconds=1.5)
    job_id, _ = await queue.enqueue(
        JobSpec(argv=("sh", "-c", "echo $$ > pid; exec sleep 300"), cwd=str(tmp_path))
    )
    async with running_worker(queue, tmp_path / "w", heartbeat_seconds=0.2) as worker:
        pid = int((await wait_file(tmp_path / "pid"))[0])
        redis_server.kill()  # unreachable: no heartbeat can renew the lease
        try:
            await wait_dead([pid])  # killed by the worker's own clock, ~1.3 s after the last renewal
            await wait_until(lambda: _idle(worker), what="the worker to drop the attempt")
        finally:
            redis_server.start()
    assert not alive(pid)
    # nothing was recorded by the cut-off worker: the job's fate is the reaper's
    info = await wait_state(queue, job_id, JobState.RUNNING, JobState.QUEUED)
    assert info.exit_code is None


async def _idle(worker: Worker) -> bool:
    return not worker.running
