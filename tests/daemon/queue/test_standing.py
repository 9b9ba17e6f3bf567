"""A standing claim (fast_path.Standing): an idle worker's next claim, sent by the next enqueue
through the same JobQueue in that enqueue's round trip, against a real redis-server; and what
that round trip makes Redis run, which is on the path to the job's start."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from daemon.job import JobSpec, JobState
from daemon.queue import keys
from daemon.queue.claims import Capacity
from daemon.queue.job_queue import JobQueue
from tests.daemon.queue.test_scripts import counting_round_trips

GIB = 2**30


def spec(n: int, queue: str = "default") -> JobSpec:
    return JobSpec(argv=("echo", str(n)), queue=queue)


async def test_a_standing_claim_travels_with_the_enqueue_and_gets_its_job(
    redis: Redis, queue: JobQueue
) -> None:
    await queue.enqueue(spec(0))  # scripts loaded, queue known: the round trips below are the calls'
    assert await queue.claim("w0", ["default"]) is not None
    standing = queue.stand("w1", ["default"], 2)
    assert standing is not None
    made = counting_round_trips(redis)
    job_id, _ = await queue.enqueue(spec(1))
    assert standing.taken.is_set()
    assert not queue.withdraw(standing)  # sent: it is answered, not taken back
    [lease] = await queue.standing_claimed(standing)
    assert len(made) == 1  # the enqueue and the claim, in one round trip
    assert (lease.job_id, lease.attempt, lease.worker) == (job_id, 1, "w1")
    info = await queue.get(job_id)
    assert (info.state, info.worker) == (JobState.RUNNING, "w1")


async def test_a_standing_claim_takes_its_enqueues_spec_as_it_is_and_decodes_any_other(
    queue: JobQueue,
) -> None:
    """The spec the enqueue packed is at hand: the job with those very bytes gets that JobSpec,
    not a decoded copy; a job queued before it (another spec) is decoded from what Redis holds."""
    older, _ = await queue.enqueue(spec(0))
    standing = queue.stand("w1", ["default"], 2)
    assert standing is not None
    mine = JobSpec(argv=("echo", "mine"), queue="default", env={"A": "1"}, timeout=5.0)
    job_id, _ = await queue.enqueue(mine)
    first, second = await queue.standing_claimed(standing)
    assert (first.job_id, first.spec) == (older, spec(0))
    assert (second.job_id, second.spec) == (job_id, mine)
    assert second.spec is mine


async def test_a_standing_claim_is_sent_only_for_its_queues_and_never_once_withdrawn(queue: JobQueue) -> None:
    standing = queue.stand("w1", ["gpu"], 1)
    assert standing is not None
    other, _ = await queue.enqueue(spec(1))  # another queue: not sent
    assert not standing.taken.is_set()
    assert queue.withdraw(standing)  # never sent: nothing claimed
    later, _ = await queue.enqueue(spec(2, "gpu"))
    assert not standing.taken.is_set()
    assert (await queue.get(other)).state is JobState.QUEUED
    assert (await queue.get(later)).state is JobState.QUEUED


async def test_a_standing_claim_whose_reply_was_never_read_is_settled(queue: JobQueue) -> None:
    """A worker stopped between the claim's send and reading its reply: the job is its until its
    lease expires, unless the claim is asked again (settle_claims, as a draining worker does),
    which answers the same job, not a new one."""
    standing = queue.stand("w1", ["default"], 1)
    assert standing is not None
    job_id, _ = await queue.enqueue(spec(1))
    second, _ = await queue.enqueue(spec(2))
    assert standing.taken.is_set()
    assert queue.stand("w1", ["default"], 1) is None  # none while one is unanswered
    [lease] = await queue.settle_claims("w1")
    assert (lease.job_id, lease.attempt) == (job_id, 1)
    assert (await queue.get(second)).state is JobState.QUEUED


async def test_a_standing_claim_counts_the_time_it_stood_against_a_pilots_lifetime(queue: JobQueue) -> None:
    """A pilot's claim says how long the pilot has left; one that stood a while before an enqueue
    sent it has that much less, and passes over a job that would now run past the pilot's end."""
    await queue.enqueue(spec(0))  # scripts loaded: the batch below runs as sent
    assert await queue.claim("w0", ["default"]) is not None
    standing = queue.stand("pilot", ["default"], 1, Capacity(lifetime=2.0))
    assert standing is not None
    await asyncio.sleep(1.0)  # it stands: 1 s of the pilot's 2 left
    job_id, _ = await queue.enqueue(JobSpec(argv=("true",), timeout=1.4, stop_grace=0.1))
    assert not queue.withdraw(standing)
    assert await queue.standing_claimed(standing) == []
    assert (await queue.get(job_id)).state is JobState.QUEUED


def four_cpus_two_held_for_a_minute() -> Capacity:
    """A worker without GPUs of 4 CPUs, 2 of them held by a job that ends within 60 s."""
    return Capacity(cpus_free=2, cpus_total=4, mem_free=GIB, mem_total=GIB, host_ends=[(60.0, 2, 0)])


async def test_a_standing_claim_keeps_a_head_of_an_earlier_queue_from_a_later_one(queue: JobQueue) -> None:
    """issue 50 review: the head of `urgent` (4 CPUs, 2 held for a minute) is kept from `default`
    by the worker's claims of one round, but the claim it then left standing went to `default`
    keeping nothing: a job there with no time limit started on the CPUs the head waits for. Now
    it waits; and a job behind the head in the head's own queue, sure to end before it could
    start, still starts from the standing claim in its enqueue's round trip."""
    room = four_cpus_two_held_for_a_minute()
    head, _ = await queue.enqueue(JobSpec(argv=("head",), cpus=4, queue="urgent"))
    assert await queue.claim_many("w1", ["urgent", "default"], 1, room) == []
    standing = queue.stand("w1", ["urgent", "default"], 1, room)
    assert standing is not None
    endless, _ = await queue.enqueue(JobSpec(argv=("endless",), cpus=2))
    if not queue.withdraw(standing):
        assert await queue.standing_claimed(standing) == []
    assert (await queue.get(endless)).state is JobState.QUEUED
    standing = queue.stand("w1", ["urgent", "default"], 1, room)
    assert standing is not None
    short, _ = await queue.enqueue(JobSpec(argv=("short",), cpus=2, timeout=5.0, queue="urgent"))
    assert not queue.withdraw(standing)
    assert [lease.job_id for lease in await queue.standing_claimed(standing)] == [short]
    for waiting in (head, endless):
        assert (await queue.get(waiting)).state is JobState.QUEUED


async def test_a_head_a_standing_claim_reserved_is_kept_from_the_next_standing_claim(queue: JobQueue) -> None:
    """issue 50 review: a standing claim can find the head itself (the job its enqueue queued
    needs more CPUs than are free): the claim the worker leaves standing next keeps that head's
    need from its later queue, as its next round of claims would."""
    room = four_cpus_two_held_for_a_minute()
    await queue.enqueue(spec(0, "elsewhere"))  # scripts loaded: the batches below run as sent
    assert await queue.claim_many("w1", ["urgent", "default"], 1, room) == []
    standing = queue.stand("w1", ["urgent", "default"], 1, room)
    assert standing is not None
    head, _ = await queue.enqueue(JobSpec(argv=("head",), cpus=4, queue="urgent"))
    assert not queue.withdraw(standing)
    assert await queue.standing_claimed(standing) == []
    standing = queue.stand("w1", ["urgent", "default"], 1, room)
    assert standing is not None
    endless, _ = await queue.enqueue(JobSpec(argv=("endless",), cpus=2))
    if not queue.withdraw(standing):
        assert await queue.standing_claimed(standing) == []
    for waiting in (head, endless):
        assert (await queue.get(waiting)).state is JobState.QUEUED


async def _commands(redis: Redis) -> dict[str, int]:
    """How many times Redis has run each command, scripts' own included."""
    stats = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


async def test_a_claim_that_empties_a_plain_queue_makes_no_look_it_does_not_need(
    redis: Redis, queue: JobQueue
) -> None:
    """After an idle spell each command a claim runs costs Redis ~8 us on the path to a job's
    start. One that takes the last job of a queue where nothing waits at the front (retried,
    parked, held at a cap) or with a priority looks at neither (one EXISTS for all four),
    takes a job without a priority out of no `prio`, and knows where to wait from the entry it
    took: no XINFO."""
    job_id, _ = await queue.enqueue(spec(0))
    entry = await redis.hget(keys.job(job_id), "entry")
    before = await _commands(redis)
    [lease] = await queue.claim_many("w1", ["default"], 2)
    ran = {name: n - before.get(name, 0) for name, n in (await _commands(redis)).items()}
    assert lease.job_id == job_id
    unneeded = ("xinfo", "zrange", "zrangebyscore", "zrem")  # xinfo: Redis 7 counts `xinfo|groups`
    looks = {look: sum(n for name, n in ran.items() if name.split("|")[0] == look) for look in unneeded}
    assert looks == dict.fromkeys(unneeded, 0)
    assert isinstance(entry, bytes)
    assert queue._cursors["default"][0] == entry.decode()  # where its next wait starts


async def test_an_enqueue_runs_one_script_and_names_its_queue_with_a_plain_sadd(
    redis: Redis, queue: JobQueue
) -> None:
    """The queue set is written in the enqueue's round trip by SADD itself: a script of one SADD
    cost Redis ~40 us after an idle spell (most of it the shared helpers every script loads),
    SADD ~5. What it does is the same: the queue is named, the next enqueue names it again."""
    await queue.enqueue(spec(0))
    await redis.srem(keys.QUEUES, "default")  # as if that write had been lost
    before = await _commands(redis)
    await queue.enqueue(spec(1))
    ran = {name: n - before.get(name, 0) for name, n in (await _commands(redis)).items()}
    assert (ran.get("evalsha", 0), ran.get("sadd", 0)) == (1, 1)
    assert await redis.smembers(keys.QUEUES) == {b"default"}


async def test_a_claim_no_slot_waits_for_rides_with_the_calls_of_its_turn(
    redis: Redis, queue: JobQueue
) -> None:
    """A claim a slot waits for goes ahead of the calls made with it, in a round trip of its own
    (fast_path.Pipeliner); one made while every slot is taken (`urgent=False`: look-ahead) is in
    no hurry, and shares the round trip of the calls made in its turn (an outcome, say)."""
    for n in range(4):
        await queue.enqueue(spec(n))
    assert await queue.claim("w0", ["default"]) is not None  # scripts loaded, the queue known
    for urgent, trips in ((True, 2), (False, 1)):
        made = counting_round_trips(redis)
        leases, (job_id, _) = await asyncio.gather(
            queue.claim_many("w1", ["default"], 1, urgent=urgent), queue.enqueue(spec(9))
        )
        assert len(made) == trips, (urgent, made)
        [lease] = leases
        assert (lease.worker, (await queue.get(lease.job_id)).state) == ("w1", JobState.RUNNING)
        assert (await queue.get(job_id)).state is JobState.QUEUED
