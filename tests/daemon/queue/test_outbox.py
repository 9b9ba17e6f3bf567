"""The outbox of job ends to notify (daemon/queue/outbox.py, outbox_take.lua, outbox_settle.lua), on
one redis-server and on a Redis Cluster with its queues on three shards: what an end puts there,
who may take an entry and when, and that only its holder settles it."""

from __future__ import annotations

import asyncio

import pytest

from daemon.job import JobSpec
from daemon.queue import keys
from daemon.queue.connection import AnyRedis
from daemon.queue.job_queue import JobQueue
from daemon.queue.outbox import Outbox, Taken, Verdict
from tests.daemon.queue.conftest import Server
from tests.daemon.queue.test_cluster import queues_on_shards
from tests.support.cluster import ClusterServer

HOLD = 0.3  # seconds a take holds an entry, here


@pytest.fixture
def redis(either_redis: AnyRedis) -> AnyRedis:
    """Each test here runs on one redis-server and on a Redis Cluster (conftest.py)."""
    return either_redis


def three_queues(server: Server) -> list[str]:
    return queues_on_shards(server.group, 3) if isinstance(server, ClusterServer) else ["q0", "q1", "q2"]


async def took_all(outbox: Outbox, queues: list[str]) -> dict[str, Taken]:
    """What one sweep of `queues` takes, by member."""
    out: dict[str, Taken] = {}
    for _, took in await outbox.take_due(queues, 10):
        assert not isinstance(took, Exception)
        out.update((t.member, t) for t in took.taken)
    return out


async def test_an_entry_is_held_by_one_taker_retried_by_any_and_settled_by_its_holder_alone(
    server: Server, queue: JobQueue
) -> None:
    """issue 43 item 7 (webhooks): the outbox's hold. A job's end puts one entry per target its
    record names; one sweep takes every due entry of every queue, and while it holds them no other
    take sees them. A retry comes due after its pause, to whichever taker comes, its attempt
    counted; a delivered entry is gone; a hold that lapses (its taker killed) lets another take
    the entry, and the first can then settle nothing: its fence is stale."""
    names = three_queues(server)
    notifying = JobQueue(queue.redis, lease_seconds=30, notify_pool=True)
    ids = []
    for q in names:
        job_id, _ = await notifying.enqueue(JobSpec(argv=("true",), queue=q, notify="http://h.example/x"))
        await notifying.cancel(job_id)
        ids.append(job_id)
    quiet, _ = await queue.enqueue(JobSpec(argv=("true",), queue=names[0]))  # nothing to notify
    await queue.cancel(quiet)
    first, second = Outbox(queue, HOLD), Outbox(queue, HOLD)

    taken = await took_all(first, names)
    assert sorted(taken) == sorted(f"{i}/{target}" for i in ids for target in ("job", "pool"))
    assert {t.tries for t in taken.values()} == {0}
    assert await took_all(second, names) == {}  # held
    assert (await second.take_ended(names[0], [ids[0], quiet], 10)).taken == []

    retried, delivered, lapsed = (taken[f"{i}/job"] for i in ids)
    assert await first.settle(retried, Verdict.RETRY, pause=HOLD * 2)
    assert await first.settle(delivered, Verdict.DONE)
    assert not await first.settle(delivered, Verdict.DONE)  # run twice: no second effect
    assert await first.hand_back([taken[f"{i}/pool"] for i in ids]) == 3  # due at once, uncounted

    again: dict[str, Taken] = {}
    async with asyncio.timeout(10):
        while lapsed.member not in again or retried.member not in again:
            await asyncio.sleep(HOLD / 4)
            again.update(await took_all(second, names))
    assert lapsed.fence != again[lapsed.member].fence
    assert not await first.settle(lapsed, Verdict.DONE)  # its hold lapsed: no longer its own
    assert await second.settle(again[lapsed.member], Verdict.DONE)
    assert again[retried.member].tries == 1
    assert delivered.member not in again
    assert await queue.redis.zscore(keys.outbox(names[1]), delivered.member) is None
