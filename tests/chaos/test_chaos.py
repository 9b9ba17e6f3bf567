"""Chaos: real worker processes, a real redis-server and a real server process, with faults of
every kind injected while jobs flow; then the checker verifies every guarantee (docs/GUARANTEES.md).

The small variants run in `make test`; the large ones (`-m slow`) are what `make chaos` runs. With
`workflows`, the workflow features flow among the plain jobs (tests/chaos/workflows.py: dependency
chains, `%N` arrays with and without `--after`, checkpoints with requeue and preemption on workers
with made-up GPUs, `--gpu-mem` jobs, webhooks to a receiver, pilots that leave and are replaced),
and the checker's workflow rules judge them (tests/chaos/workflow_rules.py)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
from pathlib import Path

import pytest

from daemon.queue.embedded_redis import EmbeddedRedis
from tests.chaos.checker import check
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
from tests.chaos.history import Verdict
from tests.chaos.workflow_rules import WorkflowRun
from tests.chaos.workflows import Workflows
from tests.support.cluster import ClusterGroup
from tests.support.sentinel import SentinelGroup
from tests.support.webhooks import Receiver, receiver, user_key

KINDS = ["kill", "stop", "redis", "server", "rollback", "full", "stale"]  # harness.Cluster.inject
# With the workflow features, running checkpointing jobs are requeued too (early: the first units'
# are running then).
WORKFLOW_KINDS = [KINDS[0], "requeue", *KINDS[1:]]
# On a Sentinel group, Redis's own faults are failovers (and no proxy stands before a worker).
SENTINEL_KINDS = ["failover", "kill", "stop", "server", "failover"]
GPU_WORKERS = 2  # workers with made-up GPUs, serving the GPU queue (workflows)
PILOTS = 2  # pilot workers on the default queue, each replaced as it leaves (workflows)


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
    workflows: int = 0,
) -> tuple[Verdict, Cluster]:
    """A pool under faults; `workflows`: that many workflow units (tests/chaos/workflows.py) are
    spread over the plain jobs, with GPU workers, pilots and a webhook receiver."""
    async with contextlib.AsyncExitStack() as stack:
        hook = await stack.enter_async_context(receiver()) if workflows else None
        cluster = await start_pool(
            tmp, redis_server, s3_env, workers, lease=lease, policies=policies, hook=hook
        )
        submitter = Submitter(cluster)
        flows = Workflows(cluster, submitter, hook.url) if hook is not None else None
        pilots_done = asyncio.Event()
        keeper = asyncio.create_task(cluster.keep_pilots(pilots_done))
        # With the policies on, jobs come from three users in turn (the long ones too: shifted by
        # one each LONG_EVERY, or one user at a cap would hold them all), every 7th with a priority.
        by_user = {u: Submitter(cluster, u) for u in USERS} if policies else {}
        try:
            rng = random.Random(seed)
            await flow(
                cluster,
                submitter,
                by_user,
                flows,
                jobs=jobs,
                units=workflows,
                kinds=kinds,
                rounds=rounds,
                rng=rng,
            )
            run = None
            if flows is not None and hook is not None:
                keys = {user: user_key(token) for user, token in cluster.tokens.items()}
                secret = cluster.notify_secret
                run = WorkflowRun(flows.done, hook.posts, secret, pool_notify=True, user_keys=keys)
            async with cluster.queue() as queue:
                verdict = await check(cluster, queue, submitter.acked, workflows=run)
        finally:
            pilots_done.set()  # before the pilots are stopped, or they would be replaced
            await asyncio.wait_for(keeper, 5)
            for one in (submitter, *by_user.values()):
                await one.close()
            await cluster.stop_all()
    return verdict, cluster


async def flow(
    cluster: Cluster,
    submitter: Submitter,
    by_user: dict[str, Submitter],
    flows: Workflows | None,
    *,
    jobs: int,
    units: int,
    kinds: list[str],
    rounds: int,
    rng: random.Random,
) -> None:
    """The jobs (and the workflow units among them), an idempotency storm, and the faults, at once."""
    spec = {"argv": job_command(cluster.ledger, JOB_SECONDS), "max_attempts": 10}
    long_spec = {"argv": job_command(cluster.ledger, LONG_SECONDS), "max_attempts": 10}
    short_spec = {"argv": job_command(cluster.ledger, 0), "max_attempts": 10}

    async def submit_all() -> None:
        for i in range(jobs):
            job = long_spec if i % LONG_EVERY == 0 else short_spec if i % SHORT_EVERY == 1 else spec
            if by_user:
                user = by_user[USERS[(i + i // LONG_EVERY) % len(USERS)]]
                job_id = await user.submit(f"job-{i}", {**job, "priority": 5 if i % 7 == 0 else 0})
                submitter.acked.setdefault(job_id, user.acked[job_id])
            else:
                await submitter.submit(f"job-{i}", job)
            if flows is not None and i % max(1, jobs // units) == 0 and flows.done.units < units:
                await flows.unit(flows.done.units)
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


async def start_pool(
    tmp: Path,
    redis_server: EmbeddedRedis | SentinelGroup | ClusterGroup,
    s3_env: dict[str, str],
    workers: int,
    *,
    lease: float,
    policies: bool,
    hook: Receiver | None,
) -> Cluster:
    """The pool's server and `workers` workers, registered; with a `hook` (the workflows), the
    GPU workers and pilots too, and the server POSTs every job's end to it."""
    cluster = Cluster(
        tmp,
        redis_server,
        lease=lease,
        s3_env=s3_env,
        policies=policies,
        workflows=hook is not None,
        notify_url=hook.url if hook is not None else "",
        notify_secret=secrets.token_hex(16),
    )
    if cluster.proxy is not None:
        await cluster.proxy.start()
    await cluster.start_server()
    for _ in range(workers):
        cluster.start_worker()
    for kind in ["gpu"] * GPU_WORKERS + ["pilot"] * PILOTS if hook is not None else []:
        cluster.start_worker(kind)
    await cluster.workers_registered(len(cluster.workers))
    return cluster


def report(verdict: Verdict, cluster: Cluster) -> str:
    f = cluster.faults
    return (
        f"jobs {verdict.jobs}, attempts run {verdict.attempts_run}, reclaimed jobs {verdict.reclaimed_jobs}; "
        f"faults: worker SIGKILL {f.worker_kill}, worker SIGSTOP {f.worker_stop}, redis restart "
        f"{f.redis_restart}, redis rollback {f.redis_rollback}, redis full {f.redis_full}, stale replies "
        f"{f.stale_replies}, server restart {f.server_restart}, idempotency storm {f.idempotency_storm}, "
        f"Redis failovers {f.failover} ({', '.join(f'{s:.2f}' for s in f.failover_seconds) or '-'} s); "
        f"lost {verdict.lost} (and {verdict.rolled_back} rolled back with Redis's lost writes, as "
        f"documented), unexpected {verdict.unexpected}, wrong ends {verdict.wrong_ends}, "
        f"results not once {verdict.results_not_once}, overlaps {verdict.overlaps} (of them frozen "
        f"workers' jobs killed by their guard: {verdict.guard_kills}), outcomes from attempts that never "
        f"ended {verdict.unknown_ends}, FIFO violations {verdict.fifo_violations}"
        + (workflow_report(verdict, cluster) if cluster.workflows else "")
    )


def workflow_report(verdict: Verdict, cluster: Cluster) -> str:
    """The workflow features' figures (tests/chaos/workflow_rules.py), to go after report's."""
    f, v = cluster.faults, verdict
    return (
        f"; workflows: requeue faults {f.requeue} ({f.requeued} jobs requeued), pilots that left "
        f"{f.pilots_left} (refused at their start by a Redis at fault {f.pilots_refused}, ended "
        f"otherwise {f.pilot_failures}); still under way {v.still_running}; "
        f"dependents {v.dependents}: early starts {v.early_starts}, run though unmet {v.unmet_runs}, "
        f"wrongly refused {v.wrong_refusals}; arrays {v.arrays}: most running at once {v.most_under_way}, "
        f"over the window {v.window_excess}; checkpoint restores {v.restores} (bad {v.bad_restores}), "
        f"preempted attempts {v.preempted}; attempts on pilots {v.pilot_attempts}, on GPUs "
        f"{v.gpu_attempts} ({v.shared_attempts} shared), GPUs over-committed {v.gpu_overcommit}; "
        f"webhooks owed {v.notified}: missing {v.hooks_missing}, duplicates {v.hook_duplicates}, "
        f"bad {v.hooks_bad}"
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


async def test_chaos_workflows_small(
    tmp_path: Path, redis_server: EmbeddedRedis, s3_env: dict[str, str]
) -> None:
    """issue 43, the chaos suite: the workflow features (dependency chains, `%N` arrays with and
    without `--after`, checkpoints requeued and preempted, `--gpu-mem` jobs on workers with
    made-up GPUs, webhooks, pilots that leave) among the plain jobs, under one fault of each kind
    and a requeue: every rule holds, and each feature was met."""
    await workflow_chaos(
        tmp_path, redis_server, s3_env, jobs=60, workers=3, rounds=len(WORKFLOW_KINDS), units=2
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_chaos_workflows_large(
    tmp_path: Path, redis_server: EmbeddedRedis, s3_env: dict[str, str]
) -> None:
    """issue 43, the chaos suite, as `make chaos` runs it: 16 workflow units among 2 000 plain
    jobs, 40 faults."""
    await workflow_chaos(tmp_path, redis_server, s3_env, jobs=2000, workers=4, rounds=40, units=16, seed=19)


async def workflow_chaos(
    tmp: Path,
    redis_server: EmbeddedRedis,
    s3_env: dict[str, str],
    *,
    jobs: int,
    workers: int,
    rounds: int,
    units: int,
    seed: int = 7,
) -> None:
    verdict, cluster = await run_chaos(
        tmp,
        redis_server,
        s3_env,
        jobs=jobs,
        workers=workers,
        rounds=rounds,
        lease=1.5,
        seed=seed,
        kinds=WORKFLOW_KINDS,
        workflows=units,
    )
    print(report(verdict, cluster))
    assert verdict.ok, report(verdict, cluster) + "\n" + "\n".join(verdict.problems[:20])
    f = cluster.faults
    assert not f.pilot_failures, [what for _, what in f.log if what.startswith("pilot")]
    met = [f.requeued, f.pilots_left, verdict.pilot_attempts, verdict.dependents, verdict.arrays]
    met += [verdict.restores, verdict.preempted, verdict.shared_attempts, verdict.notified]
    assert all(met), report(verdict, cluster)
