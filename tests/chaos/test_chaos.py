"""Chaos: real worker processes, a real redis-server and a real server process, with faults of
every kind injected while jobs flow; then the checker verifies every guarantee (docs/GUARANTEES.md).

The small variant runs in `make test`; the large one (`-m slow`) is what `make chaos` runs."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from daemon.queue.embedded_redis import EmbeddedRedis
from tests.chaos.checker import Verdict, check
from tests.chaos.harness import (
    JOB_SECONDS,
    LONG_EVERY,
    LONG_SECONDS,
    SHORT_EVERY,
    USERS,
    Cluster,
    Submitter,
    job_command,
)
from tests.support.cluster import ClusterGroup
from tests.support.sentinel import SentinelGroup

KINDS = ["kill", "stop", "redis", "server", "rollback", "full", "stale"]  # harness.Cluster.inject
# On a Sentinel group, Redis's own faults are failovers (and no proxy stands before a worker).
SENTINEL_KINDS = ["failover", "kill", "stop", "server", "failover"]


async def run_chaos(
    tmp: Path,
    redis_server: EmbeddedRedis | SentinelGroup | ClusterGroup,
    s3_env: dict[str, str],
    *,
    jobs: int,
    workers: int,
    rounds: int,
    lease: float,
    seed: int,
    kinds: list[str] = KINDS,
    policies: bool = False,
) -> tuple[Verdict, Cluster]:
    rng = random.Random(seed)
    cluster = Cluster(tmp, redis_server, lease=lease, s3_env=s3_env, policies=policies)
    if cluster.proxy is not None:
        await cluster.proxy.start()
    await cluster.start_server()
    for _ in range(workers):
        cluster.start_worker()
    await cluster.workers_registered(workers)
    submitter = Submitter(cluster)
    # With the policies on, jobs come from three users in turn (the long ones too: shifted by one
    # each LONG_EVERY, or one user at a cap would hold them all), every 7th with a priority.
    by_user = {u: Submitter(cluster, u) for u in USERS} if policies else {}
    spec = {"argv": job_command(cluster.ledger, JOB_SECONDS), "max_attempts": 10}
    long_spec = {"argv": job_command(cluster.ledger, LONG_SECONDS), "max_attempts": 10}
    short_spec = {"argv": job_command(cluster.ledger, 0), "max_attempts": 10}
    try:

        async def submit_all() -> None:
            for i in range(jobs):
                job = long_spec if i % LONG_EVERY == 0 else short_spec if i % SHORT_EVERY == 1 else spec
                if policies:
                    user = by_user[USERS[(i + i // LONG_EVERY) % len(USERS)]]
                    job_id = await user.submit(f"job-{i}", {**job, "priority": 5 if i % 7 == 0 else 0})
                    submitter.acked.setdefault(job_id, user.acked[job_id])
                else:
                    await submitter.submit(f"job-{i}", job)
                if i % 10 == 0:
                    await asyncio.sleep(0.05)  # a steady flow, so faults land mid-stream

        async def storm() -> None:
            # the same idempotency key from many clients at once: one job
            cluster.faults.idempotency_storm += 1
            cluster.faults.note("idempotency storm")
            others = [Submitter(cluster) for _ in range(12)]
            got = await asyncio.gather(*(s.submit("storm", spec) for s in others))
            for s in others:
                await s.close()
            assert len(set(got)) == 1, got
            submitter.ids["storm"] = got[0]
            submitter.acked.setdefault(got[0], min(s.acked[got[0]] for s in others))

        async def faults() -> None:
            for r in range(rounds):
                await asyncio.sleep(rng.uniform(0.5, 1.5))
                await cluster.inject(kinds[r % len(kinds)] if r < len(kinds) else rng.choice(kinds), rng)

        await asyncio.gather(submit_all(), storm(), faults())
        async with cluster.queue() as queue:
            verdict = await check(cluster, queue, submitter.acked)
    finally:
        await submitter.close()
        for user in by_user.values():
            await user.close()
        await cluster.stop_all()
    return verdict, cluster


def report(verdict: Verdict, cluster: Cluster) -> str:
    f = cluster.faults
    return (
        f"jobs {verdict.jobs}, attempts run {verdict.attempts_run}, reclaimed jobs {verdict.reclaimed_jobs}; "
        f"faults: worker SIGKILL {f.worker_kill}, worker SIGSTOP {f.worker_stop}, redis restart "
        f"{f.redis_restart}, redis rollback {f.redis_rollback}, redis full {f.redis_full}, stale replies "
        f"{f.stale_replies}, server restart {f.server_restart}, idempotency storm {f.idempotency_storm}, "
        f"Redis failovers {f.failover} ({', '.join(f'{s:.2f}' for s in f.failover_seconds) or '-'} s); "
        f"lost {verdict.lost} (and {verdict.rolled_back} rolled back with Redis's lost writes, as "
        f"documented), unexpected {verdict.unexpected}, not succeeded {verdict.not_succeeded}, "
        f"results not once {verdict.results_not_once}, overlaps {verdict.overlaps} (of them frozen "
        f"workers' jobs killed by their guard: {verdict.guard_kills}), outcomes from attempts that never "
        f"ended {verdict.unknown_ends}, FIFO violations {verdict.fifo_violations}"
    )


async def test_chaos_small(tmp_path: Path, redis_server: EmbeddedRedis, s3_env: dict[str, str]) -> None:
    verdict, cluster = await run_chaos(
        tmp_path, redis_server, s3_env, jobs=120, workers=3, rounds=len(KINDS), lease=1.5, seed=7
    )
    print(report(verdict, cluster))
    assert verdict.ok, report(verdict, cluster) + "\n" + "\n".join(verdict.problems[:20])
    f = cluster.faults
    assert all((f.worker_kill, f.worker_stop, f.redis_restart, f.server_restart))
    assert all((f.redis_rollback, f.redis_full, f.stale_replies))


async def test_chaos_policies_small(
    tmp_path: Path, redis_server: EmbeddedRedis, s3_env: dict[str, str]
) -> None:
    """With fair share, a cap per user and preemption by priority on, jobs of three users, some
    with a priority: the same guarantees, and FIFO within each user's jobs of one priority."""
    verdict, cluster = await run_chaos(
        tmp_path,
        redis_server,
        s3_env,
        jobs=120,
        workers=3,
        rounds=len(KINDS),
        lease=1.5,
        seed=5,
        policies=True,
    )
    print(report(verdict, cluster))
    assert verdict.ok, report(verdict, cluster) + "\n" + "\n".join(verdict.problems[:20])


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_chaos_policies_large(
    tmp_path: Path, redis_server: EmbeddedRedis, s3_env: dict[str, str]
) -> None:
    verdict, cluster = await run_chaos(
        tmp_path, redis_server, s3_env, jobs=2000, workers=4, rounds=40, lease=1.5, seed=13, policies=True
    )
    print(report(verdict, cluster))
    assert verdict.ok, report(verdict, cluster) + "\n" + "\n".join(verdict.problems[:20])


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_chaos_large(tmp_path: Path, redis_server: EmbeddedRedis, s3_env: dict[str, str]) -> None:
    verdict, cluster = await run_chaos(
        tmp_path, redis_server, s3_env, jobs=2000, workers=4, rounds=40, lease=1.5, seed=11
    )
    print(report(verdict, cluster))
    assert verdict.ok, report(verdict, cluster) + "\n" + "\n".join(verdict.problems[:20])


async def sentinel_chaos(  # noqa: PLR0917
    tmp: Path,
    group: SentinelGroup | ClusterGroup,
    s3_env: dict[str, str],
    jobs: int,
    workers: int,
    rounds: int,
    seed: int,
) -> None:
    verdict, cluster = await run_chaos(
        tmp,
        group,
        s3_env,
        jobs=jobs,
        workers=workers,
        rounds=rounds,
        lease=1.5,
        seed=seed,
        kinds=SENTINEL_KINDS,
    )
    print(report(verdict, cluster))
    assert verdict.ok, report(verdict, cluster) + "\n" + "\n".join(verdict.problems[:20])
    assert cluster.faults.failover >= 2


async def test_chaos_sentinel_small(
    tmp_path: Path, sentinel_group_of_three: SentinelGroup, s3_env: dict[str, str]
) -> None:
    """The pool on a Sentinel group (a primary, two replicas): failovers among the other faults."""
    await sentinel_chaos(
        tmp_path, sentinel_group_of_three, s3_env, jobs=80, workers=2, rounds=len(SENTINEL_KINDS), seed=5
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_chaos_sentinel_large(
    tmp_path: Path, sentinel_group_of_three: SentinelGroup, s3_env: dict[str, str]
) -> None:
    await sentinel_chaos(tmp_path, sentinel_group_of_three, s3_env, jobs=1000, workers=3, rounds=20, seed=13)


async def test_chaos_cluster_small(tmp_path: Path, s3_env: dict[str, str]) -> None:
    """The pool on a Redis Cluster (three primaries, a replica each): shard primaries killed and
    failed over among the other faults."""
    with ClusterGroup(tmp_path / "cluster", replicas=1) as group:
        await sentinel_chaos(tmp_path, group, s3_env, jobs=80, workers=2, rounds=len(SENTINEL_KINDS), seed=5)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_chaos_cluster_large(tmp_path: Path, s3_env: dict[str, str]) -> None:
    with ClusterGroup(tmp_path / "cluster", replicas=1) as group:
        await sentinel_chaos(tmp_path, group, s3_env, jobs=1000, workers=3, rounds=20, seed=17)
