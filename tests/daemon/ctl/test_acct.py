"""`poolctl acct` (issue 50, accounting) against a real pool on a real Redis: the queue stand-in
claims and ends jobs as a worker would, poolctl runs as a subprocess, and its totals are checked
against what the jobs' records and attempts say they ran."""

from __future__ import annotations

import asyncio
import calendar
import json
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from daemon.client.pool_client import ClientError
from daemon.job import JobState, Outcome
from daemon.queue import keys
from daemon.queue.claims import Capacity
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.scripts import source
from protocol import Account, Accounted, Enqueue, Enqueued, ErrorCode
from tests.support.pool import Pool, running_pool
from tests.support.poolctl import poolctl

RUN = 0.15  # seconds each attempt runs: long enough to be measured in ms, short for the suite


@pytest.fixture
async def pool(redis_server: EmbeddedRedis, tmp_path: Path) -> AsyncIterator[Pool]:
    # job_retention of 1 s: the jobs' own records are gone long before their accounting records
    async with running_pool(
        redis_server, tmp_path, users=("alice", "bob", "root"), admins=("root",), job_retention=1
    ) as p:
        yield p


async def enqueue(pool: Pool, user: str, gpus: int) -> str:
    async with pool.client(user) as c:
        return (
            await c.call(Enqueue({"argv": ["true"], "gpus": gpus, "wait_for_worker": True}, None), Enqueued)
        ).job_id


async def run(
    pool: Pool, job_id: str, state: JobState, *, handed_back_first: bool = False, util: float | None = None
) -> None:
    """Claim `job_id` as a four-GPU worker would, let it run RUN, and end it as `state`, with the
    usage summary a worker's outcome carries when `util` (its GPUs' mean utilisation, 0 to 1) is
    given; first hand one attempt back after RUN (a second attempt: both count)."""
    for _ in range(2 if handed_back_first else 1):
        (lease,) = await pool.queue.claim_many("stand-in", ["default"], 1, Capacity(4, gpus_total=4))
        assert lease.job_id == job_id
        await asyncio.sleep(RUN)
        if handed_back_first:
            await pool.queue.hand_back(lease)
            handed_back_first = False
            continue
        usage = {} if util is None else {"gpu_usage": {"efficiency": util}}
        code = 0 if state is JobState.SUCCEEDED else 1
        await pool.queue.complete(lease, Outcome(state, exit_code=code, result=usage))


async def ran(pool: Pool, job_id: str) -> tuple[float, float]:
    """GPU-hours the job's attempts held (GPUs times run time, from its record and attempts), and
    its wait (s, enqueue to first start), read before its record expires."""
    record = await pool.queue.redis.hgetall(keys.job(job_id))
    attempts = [json.loads(a) for a in await pool.queue.redis.lrange(keys.attempts(job_id), 0, -1)]
    gpus = int(record[b"held_gpus"])
    gpu_hours = sum(gpus * (a["ended_at"] - a["started_at"]) for a in attempts) / 1000 / 3600
    return gpu_hours, (attempts[0]["started_at"] - int(record[b"enqueued_at"])) / 1000


def p50(values: list[float]) -> float:
    return sorted(values)[math.ceil(0.5 * len(values)) - 1]


async def acct(pool: Pool, user: str, *args: str) -> dict[str, Any]:
    code, out, err = await poolctl(pool.env(user), "acct", "--json", *args)
    assert code == 0, err
    reply: dict[str, Any] = json.loads(out)
    return reply


async def test_acct_totals_across_two_users_match_the_jobs_that_ran_and_outlive_their_records(
    pool: Pool,
) -> None:
    """issue 50, accounting: after jobs of two users ran (one handed back and run again, one
    failed), `poolctl acct` as an admin gives each user's jobs, GPU-hours (the attempts' GPUs
    times their run times), CPU-hours (the CPUs a job asked for, where it did), failures, wait
    p50 and efficiency (the GPU utilisation a worker's outcome reported, weighted by GPU-hours;
    none where none was reported) as the jobs' records say, and gives them again
    once those records have expired (job_retention 1 s): the accounting records outlive them."""
    alice = [await enqueue(pool, "alice", 2), await enqueue(pool, "alice", 0)]
    bob = [await enqueue(pool, "bob", 1)]
    # bob's job asked for 2 CPUs, as an enqueue records --cpus where CPUs are a resource
    await pool.queue.redis.hset(keys.job(bob[0]), "cpus", 2)
    used = {}  # job id -> (GPU-hours, wait), read at its end, before its record expires (1 s)
    # alice's first job ends with its worker's usage summary: its GPUs busy half the time
    for job_id, util in ((alice[0], 0.5), (alice[1], None)):
        await run(pool, job_id, JobState.SUCCEEDED, util=util)
        used[job_id] = await ran(pool, job_id)
    await run(pool, bob[0], JobState.FAILED, handed_back_first=True)
    used[bob[0]] = await ran(pool, bob[0])
    expected = {}
    for user, ids, failed in (("alice", alice, 0), ("bob", bob, 1)):
        expected[user] = (
            len(ids),
            sum(used[j][0] for j in ids),
            failed,
            p50([used[j][1] for j in ids]),
            0.5 if user == "alice" else None,  # alice's only GPU job ran at 50 %; bob's: unknown
            0.0 if user == "alice" else 2 * sum(used[j][0] for j in ids),  # bob's: 2 CPUs to 1 GPU
        )
    assert expected["bob"][1] > 0
    assert expected["alice"][1] > 0

    def check(rows: list[dict[str, Any]]) -> None:
        assert [r["user"] for r in rows] == ["alice", "bob"]
        for row in rows:
            jobs, gpu_hours, failed, wait, efficiency, cpu_hours = expected[row["user"]]
            assert (row["jobs"], row["failed"]) == (jobs, failed)
            assert row["gpu_hours"] == pytest.approx(gpu_hours, rel=1e-9)
            assert row["wait_p50"] == pytest.approx(wait, rel=0.01, abs=0.001)  # the sketch's 1 %
            assert row["efficiency"] == efficiency
            assert row["cpu_hours"] == pytest.approx(cpu_hours, rel=1e-9)

    check((await acct(pool, "root"))["rows"])
    async with asyncio.timeout(5):  # job_retention: 1 s
        while any([await pool.queue.redis.exists(keys.job(j)) for j in alice + bob]):
            await asyncio.sleep(0.1)
    ttl = await pool.queue.redis.ttl(keys.accounting("default", int(time.time() // 86400)))
    assert ttl > 399 * 86400  # accounting_retention_days: 400
    check((await acct(pool, "root", "--since", "1d"))["rows"])


async def test_acct_shows_a_user_only_themselves_and_an_admin_everyone(pool: Pool) -> None:
    """issue 50, accounting: alice sees her own jobs only (bob's job is not counted for her), and
    asking for bob's is refused with a sentence (PERMISSION_DENIED: exit 6); root, an admin,
    sees both and may ask for bob alone. The table and --csv print the same rows."""
    await run(pool, await enqueue(pool, "alice", 1), JobState.SUCCEEDED)
    await run(pool, await enqueue(pool, "bob", 1), JobState.SUCCEEDED)
    mine = await acct(pool, "alice")
    assert [(r["user"], r["jobs"]) for r in mine["rows"]] == [("alice", 1)]
    assert mine["total"]["jobs"] == 1
    code, _, err = await poolctl(pool.env("alice"), "acct", "--user", "bob")
    assert code == 6
    assert "only a pool admin may see another user's accounting" in err
    assert [r["user"] for r in (await acct(pool, "root"))["rows"]] == ["alice", "bob"]
    assert [r["user"] for r in (await acct(pool, "root", "--user", "bob"))["rows"]] == ["bob"]
    code, out, err = await poolctl(pool.env("root"), "acct", "--by", "queue", "--csv")
    assert code == 0, err
    assert out.splitlines()[0].startswith("queue,jobs,failed,cancelled,gpu_hours")
    assert out.splitlines()[1].startswith("default,2,0,0,")
    code, out, err = await poolctl(pool.env("root"), "acct")
    assert code == 0, err
    assert [line.split()[:2] for line in out.splitlines()] == [
        ["USER", "JOBS"],
        ["alice", "1"],
        ["bob", "1"],
        ["total", "2"],
    ]


# Write a job's accounting record as `finish` does, with an explicit end time (ms): the record
# writer itself, lib/account.lua, run for a time of the test's choosing.
ACCOUNT_AT = source("lib/account") + "\nreturn account(ARGV[1], KEYS[1], ARGV[2], tonumber(ARGV[3]), 400)"


async def test_acct_by_day_groups_across_a_day_boundary(pool: Pool) -> None:
    """issue 50, accounting: records whose jobs ended a second before and a second after a UTC
    midnight (written by lib/account.lua at those explicit times) fall on two days in
    `--by day`, and --since/--until given as dates take in those days only; a bad --by or
    --since, or a span past a year, is refused with a sentence (exit 2)."""
    ids = [await enqueue(pool, "alice", 1) for _ in range(3)]
    for job_id in ids:
        await run(pool, job_id, JobState.SUCCEEDED)
    midnight = (int(time.time()) // 86400 - 10) * 86400  # ten days ago, 00:00 UTC
    for job_id, at in zip(ids, (midnight - 1, midnight + 1, midnight + 2), strict=True):
        await pool.queue.redis.eval(
            ACCOUNT_AT, 1, keys.job(job_id), keys.queue_prefix("default"), "succeeded", at * 1000
        )
    day = time.strftime("%Y-%m-%d", time.gmtime(midnight))
    before = time.strftime("%Y-%m-%d", time.gmtime(midnight - 86400))
    after = time.strftime("%Y-%m-%d", time.gmtime(midnight + 86400))
    got = await acct(pool, "alice", "--by", "day", "--since", before, "--until", after)
    assert [(r["day"], r["jobs"]) for r in got["rows"]] == [(before, 1), (day, 2)]
    assert got["since"] == calendar.timegm(time.strptime(before, "%Y-%m-%d"))
    code, _, err = await poolctl(pool.env("alice"), "acct", "--by", "week")
    assert code == 2
    assert "give --by user, queue or day" in err
    code, _, err = await poolctl(pool.env("alice"), "acct", "--since", "last tuesday")
    assert code == 2
    assert "a time back from now (30d, 12h, 2w) or a UTC date" in err
    code, _, err = await poolctl(pool.env("alice"), "acct", "--since", "400d")  # the server's bound
    assert code == 2
    assert "one request covers at most 366: ask for each year apart" in err


async def test_acct_efficiency_weighs_only_the_measured_gpu_time_and_reads_records_of_before(
    pool: Pool,
) -> None:
    """issue 50, accounting (review 50b finding 6): alice's first job runs an attempt nobody
    measured (handed back), then one at 90 %; her second runs once at 10 %. Her efficiency is
    the measured GPU-ms weighted by their utilisation over the measured GPU-ms: the unmeasured
    attempt weighs nothing (a record of one utilisation per job, weighted by all its GPU-ms,
    gave its 90 % the handed-back attempt's time too). A record written before the record
    carried its measured GPU-ms (its user holding spaces and ending in a number) reads as
    before: all its GPU-ms measured at its utilisation."""
    first, second = await enqueue(pool, "alice", 1), await enqueue(pool, "alice", 1)
    await run(pool, first, JobState.SUCCEEDED, handed_back_first=True, util=0.9)
    await run(pool, second, JobState.SUCCEEDED, util=0.1)
    measured = []  # the GPU-ms of each job's last attempt: the one its worker measured
    for job_id in (first, second):
        last = json.loads((await pool.queue.redis.lrange(keys.attempts(job_id), -1, -1))[0])
        measured.append(last["ended_at"] - last["started_at"])
    today = int(time.time() // 86400)
    into_day = int(time.time() * 1000) - today * 86_400_000
    old = f"{into_day} s 500 3600000 0 55 old user 7"  # lib/account.lua's layout before the field
    await pool.queue.redis.rpush(keys.accounting("default", today), old)
    rows = {r["user"]: r for r in (await acct(pool, "root", "--since", "1h"))["rows"]}
    truth = (0.9 * measured[0] + 0.1 * measured[1]) / sum(measured)
    assert rows["alice"]["efficiency"] == pytest.approx(truth, abs=0.006)  # utilisation kept in whole %
    assert (rows["old user 7"]["efficiency"], rows["old user 7"]["gpu_hours"]) == (0.55, 1.0)


async def test_acct_answers_one_request_of_a_user_at_a_time(pool: Pool) -> None:
    """issue 50, accounting (review 50b finding 10): a request reads every record of its span,
    whoever asks, so the server answers one acct of each user at a time: alice's second, sent
    while her first reads 40 000 records, is refused with a sentence (UNAVAILABLE), bob's at the
    same time is answered, and alice may ask again once her first is answered."""
    today = int(time.time() // 86400)
    fill = pool.queue.redis.pipeline(transaction=False)
    for day in range(10):  # each ended at its day's midnight: today's too are before now (at 01:00
        # they were after it when the test ran between 00:00 and 01:00 UTC: 36 000 counted)
        fill.rpush(keys.accounting("default", today - day), *[b"0 s 1000 3600000 0 55 alice"] * 4000)
    await fill.execute()
    request = Account(None, "default", time.time() - 11 * 86400, None, "user")
    async with pool.client("alice") as alice, pool.client("bob") as bob:
        first, second, bobs = await asyncio.gather(
            alice.call(request, Accounted),
            alice.call(request, Accounted),
            bob.call(request, Accounted),
            return_exceptions=True,
        )
        answered, refused = (first, second) if isinstance(first, Accounted) else (second, first)
        assert isinstance(answered, Accounted)
        assert answered.total["jobs"] == 40_000
        assert isinstance(refused, ClientError)
        assert refused.code == ErrorCode.UNAVAILABLE
        assert "alice already has an acct request running" in refused.message
        assert isinstance(bobs, Accounted)
        assert bobs.total["jobs"] == 0
        assert (await alice.call(request, Accounted)).total["jobs"] == 40_000
