"""The pool on a real Redis Cluster (tests/support/cluster.py): what one redis-server never shows.
Queues on different shards wake one worker's blocking read, a shard that lost its scripts gets
them again, a cancel's nudge reaches the worker through the cluster's pub/sub, a worker runs the
jobs of queues on every shard, and a primary killed mid-run fails over to its replica while the
queue carries on (once the dead node is back as the new primary's replica, since writes must
reach one): nothing acknowledged is lost, the running attempt completes once, FIFO holds,
and the worker sees a Redis new to the pool (it re-validates its leases and pauses its claims)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from daemon.errors import NotReplicated
from daemon.job import JobSpec, JobState, Outcome, queue_of
from daemon.queue import keys
from daemon.queue.connection import RunIdWatch, meet
from daemon.queue.failures import transient
from daemon.queue.job_queue import JobQueue
from daemon.queue.registry import list_workers
from daemon.queue.scripts import ReplicaAck
from tests.support.cluster import ClusterGroup, ClusterServer
from tests.support.workers import running_worker, wait_state

OK = Outcome(JobState.SUCCEEDED, exit_code=0)
T = TypeVar("T")


def queues_on_shards(cluster: ClusterGroup, shards: int) -> list[str]:
    """Queue names whose slots lie on `shards` different primaries, one queue per shard."""
    by_owner: dict[int, str] = {}
    for i in range(100):
        name = f"q{i}"
        by_owner.setdefault(cluster.owner(cluster.keyslot(keys.stream(name))), name)
        if len(by_owner) == shards:
            return list(by_owner.values())
    raise AssertionError(f"no {shards} queues on different shards among 100 names")


@asynccontextmanager
async def cluster_queue(server: ClusterServer, **kw: object) -> AsyncIterator[JobQueue]:
    watch = RunIdWatch(per_node=True)
    client = server.client(watch=watch)
    await meet(client, watch)
    try:
        yield JobQueue(client, lease_seconds=30, watch=watch, **kw)  # type: ignore[arg-type]
    finally:
        await client.aclose()


async def until_done(call: Callable[[], Awaitable[T]], timeout: float = 30.0) -> T:
    """`call()` again while the cluster fails over or a replica catches up (a transient error),
    for `timeout` at most."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except (RedisError, NotReplicated) as exc:
            if not transient(exc) or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_one_blocking_wait_wakes_for_a_job_on_either_shard(cluster_server: ClusterServer) -> None:
    first, second = queues_on_shards(cluster_server.group, 2)
    async with cluster_queue(cluster_server) as queue:
        assert await queue.claim("w1", [first, second]) is None  # the cursors: nothing yet
        waiting = asyncio.ensure_future(queue.wait_for_work([first, second], block=2.0))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await queue.enqueue(JobSpec(argv=("true",), queue=second))
        assert [stream for stream, _ in await waiting] == [keys.stream(second)]  # a timeout: []
        lease = await queue.claim("w1", [first, second])
        assert lease is not None
        assert lease.queue == second


async def test_a_shard_that_lost_its_scripts_is_given_them_again(cluster_server: ClusterServer) -> None:
    (name,) = queues_on_shards(cluster_server.group, 1)
    owner = cluster_server.group.owner(cluster_server.group.keyslot(keys.stream(name)))
    async with cluster_queue(cluster_server) as queue:
        await queue.enqueue(JobSpec(argv=("true",), queue=name))
        node = next(n for n in cluster_server.group.nodes if n.port == owner)
        with cluster_server.group.client(node) as c:
            c.script_flush()
        _job_id, created = await queue.enqueue(JobSpec(argv=("true",), queue=name))
        assert created
        lease = await queue.claim("w1", [name])
        assert lease is not None
        await queue.complete(lease, OK)
        assert (await queue.get(lease.job_id)).state is JobState.SUCCEEDED


async def test_a_worker_runs_queues_of_every_shard_and_a_cancel_reaches_it_by_pub_sub(
    cluster_server: ClusterServer, tmp_path: Path
) -> None:
    names = queues_on_shards(cluster_server.group, 3)
    async with cluster_queue(cluster_server) as queue:
        ids = [(await queue.enqueue(JobSpec(argv=("true",), queue=q)))[0] for q in names]
        # Heartbeats far apart: only the cancel's nudge (PUBLISH, on a Cluster sent to every node
        # by the cluster bus) tells the worker within the bound below.
        async with running_worker(queue, tmp_path / "w", slots=2, queues=names, heartbeat_seconds=60.0):
            for job_id in ids:
                await wait_state(queue, job_id, JobState.SUCCEEDED)
            long, _ = await queue.enqueue(JobSpec(argv=("sleep", "60"), queue=names[1]))
            await wait_state(queue, long, JobState.RUNNING)
            await asyncio.sleep(0.3)  # its subscription is made before its first job starts
            await queue.cancel(long)
            await wait_state(queue, long, JobState.CANCELLED, timeout=20)


async def test_a_primary_killed_mid_run_fails_over_and_the_queue_carries_on(tmp_path: Path) -> None:
    with ClusterGroup(tmp_path / "cluster", replicas=1) as cluster:
        server = ClusterServer(cluster)
        (name,) = queues_on_shards(cluster, 1)
        slot = cluster.keyslot(keys.stream(name))
        async with cluster_queue(server, ack=ReplicaAck(1, 1000)) as queue:
            watch = queue.watch
            assert watch is not None
            ids = [(await queue.enqueue(JobSpec(argv=("true",), queue=name)))[0] for _ in range(5)]
            assert await queue.primary_age([name]) > 3600  # as a worker's start records it
            running = await queue.claim("w1", [name])
            assert running is not None
            assert running.job_id == ids[0]
            generation = watch.generation

            dead = cluster.owner(slot)
            # redis-py reads the slot map from replicas too: a connection it holds to the replica
            # from before the failover is not a new one after it, and says nothing of a promotion.
            assert isinstance(queue.redis, RedisCluster)
            (replica,) = cluster.replicas_of(dead)
            held = queue.redis.get_node("127.0.0.1", replica.port)
            assert held is not None
            await held.execute_command("PING")
            node = next(n for n in cluster.nodes if n.port == dead)
            cluster.kill(node)
            promoted = cluster.wait_failover(slot, dead)
            assert promoted != dead
            cluster.restart(node)  # the new primary's replica, as writes must reach one

            # The running attempt's claim reached the replica (WAIT): its outcome is taken, once.
            await until_done(lambda: queue.complete(running, OK))
            assert (await queue.get(running.job_id)).state is JobState.SUCCEEDED
            assert watch.generation == generation + 1  # the promoted replica, new to the pool
            assert await queue.primary_age([name]) < 5  # so a worker starting now pauses its claims
            # Every acknowledged job is there, in order, and runs once.
            later, _ = await until_done(lambda: queue.enqueue(JobSpec(argv=("true",), queue=name)))
            claimed = []
            while (lease := await until_done(lambda: queue.claim("w2", [name]))) is not None:
                claimed.append(lease.job_id)
                await until_done(lambda lease=lease: queue.complete(lease, OK))  # type: ignore[misc]
            assert claimed == [*ids[1:], later]


async def test_a_write_no_replica_of_its_shard_confirms_is_not_acknowledged(tmp_path: Path) -> None:
    """WAIT goes to each node a batch wrote to: a shard whose replica is frozen acknowledges
    nothing, while another shard goes on; the refused submit, repeated with its key, is the same
    job once the replica answers."""
    with ClusterGroup(tmp_path / "cluster", replicas=1) as cluster:
        stuck, other = queues_on_shards(cluster, 2)
        (replica,) = cluster.replicas_of(cluster.owner(cluster.keyslot(keys.stream(stuck))))
        assert replica.proc is not None
        async with cluster_queue(ClusterServer(cluster), ack=ReplicaAck(1, 300)) as queue:
            first, _ = await queue.enqueue(JobSpec(argv=("true",), queue=stuck), "k")
            os.kill(replica.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(NotReplicated):
                    await queue.enqueue(JobSpec(argv=("true",), queue=stuck), "k2")
                _, created = await queue.enqueue(JobSpec(argv=("true",), queue=other), "k3")
                assert created  # its shard's replica confirmed it
            finally:
                os.kill(replica.proc.pid, signal.SIGCONT)
            again, created = await until_done(
                lambda: queue.enqueue(JobSpec(argv=("true",), queue=stuck), "k2")
            )
            assert not created  # kept on the primary all along: the same job
            assert again != first


async def test_workers_are_listed_on_a_cluster(cluster_server: ClusterServer, tmp_path: Path) -> None:
    """The registry's read (registrations, last heartbeats and Redis's clock) is one slot's: a
    pipeline of TIME and the registry's keys cannot be sent to a Cluster."""
    async with (
        cluster_queue(cluster_server) as queue,
        running_worker(queue, tmp_path / "w", slots=1, queues=["default"]) as worker,
    ):
        [record] = await list_workers(queue.redis)
    assert record["id"] == worker.id
    assert record["health"] == "healthy"
    assert 0 <= record["last_heartbeat_age"] < 30


async def test_a_durable_batch_whose_slot_moved_is_sent_again_where_it_lives_now(tmp_path: Path) -> None:
    """A slot given to another primary (CLUSTER SETSLOT ... NODE) after the client read the map:
    the node the batch goes to answers MOVED for that slot's calls and for the write before the
    WAIT (made in the slot of the batch's first call), and the whole batch goes again, where the
    cluster says, rather than failing: every script is safe to run twice."""
    with ClusterGroup(tmp_path / "cluster") as cluster:
        moved, stays = queues_on_shards(cluster, 1)[0], None
        moved_slot = cluster.keyslot(keys.stream(moved))
        owner = cluster.owner(moved_slot)
        for i in range(200):  # another queue on the same node, in another slot
            name = f"s{i}"
            slot = cluster.keyslot(keys.stream(name))
            if cluster.owner(slot) == owner and slot != moved_slot:
                stays = name
                break
        assert stays is not None
        async with cluster_queue(ClusterServer(cluster), ack=ReplicaAck(0, 100)) as queue:
            await queue.enqueue(JobSpec(argv=("true",), queue=stays))  # the client reads the map
            other = next(n for n in cluster.nodes if n.port != owner)
            with cluster.client(other) as c:
                other_id = c.execute_command("CLUSTER MYID")
            for node in cluster.nodes:
                with cluster.client(node) as c:
                    c.execute_command(
                        "CLUSTER SETSLOT", cluster.keyslot(keys.stream(moved)), "NODE", other_id
                    )
            ids = await queue.enqueue_many(
                [JobSpec(argv=("true",), queue=moved), JobSpec(argv=("true",), queue=stays)]
            )
            assert [queue_of(i) for i in ids] == [moved, stays]
            assert await queue.depth(moved) == 1
            assert await queue.depth(stays) == 2


def test_a_node_whose_bus_port_was_taken_before_it_bound_starts_on_other_ports(tmp_path: Path) -> None:
    """The fixture's own promise (a make test once failed on it): ports are picked free, not held,
    so another process may take one before the node binds it; the node then starts elsewhere."""
    import socket

    from tests.support.cluster import BUS_OFFSET

    group = ClusterGroup(tmp_path / "cluster", primaries=3)
    taken = group.nodes[0].port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken + BUS_OFFSET))
        squatter.listen()
        with group:
            assert group.nodes[0].port != taken
            with group.client(group.nodes[0]) as c:
                assert c.execute_command("CLUSTER INFO")["cluster_state"] == "ok"
