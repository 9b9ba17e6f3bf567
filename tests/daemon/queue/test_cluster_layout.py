"""The queue's key layout on a real Redis Cluster (tests/support/cluster.py, three primaries): every
key the scripts of one queue touch lies in that queue's one slot, so each script is legal on a
cluster; the pool-wide keys lie in a slot of their own; and queues spread over the shards. What
the Cluster client (issue 16) will rest on, checked against the cluster's own CLUSTER KEYSLOT."""

from __future__ import annotations

from pathlib import Path

from daemon.queue import keys
from tests.support.cluster import ClusterGroup

PER_QUEUE = (
    keys.stream,
    keys.front,
    keys.leases,
    keys.jobs,
    keys.ended,
    keys.parked,
    keys.wake,
    keys.seq,
    keys.events,
    keys.primary,
    keys.priority,
    keys.capped,
)


def test_each_queue_is_one_slot_the_pool_another_and_queues_spread_over_shards(tmp_path: Path) -> None:
    with ClusterGroup(tmp_path / "cluster") as cluster:
        queues = ["default", "gpu-a100", "Mixed_Case-q", *(f"q{i}" for i in range(9))]
        slot_of = {}
        for q in queues:
            job_id = f"{q}.mx8abcdefg"
            queue_keys = [f(q) for f in PER_QUEUE]
            queue_keys += [
                keys.claims(q, "worker-1"),
                keys.batch(q, "b1"),
                keys.idempotency(q, "alice", "k:1"),
                keys.replication_mark(keys.stream(q)),
            ]
            queue_keys += [
                keys.job(job_id),
                keys.attempts(job_id),
                keys.log(job_id),
                keys.queue_prefix(q) + "job:x",
            ]
            slots = {cluster.keyslot(k) for k in queue_keys}
            assert len(slots) == 1, (q, slots)
            slot_of[q] = slots.pop()
        pool = {cluster.keyslot(k) for k in (keys.QUEUES, keys.WORKERS, keys.WORKERS_SEEN)}
        assert len(pool) == 1
        shards = {cluster.owner(slot) for slot in slot_of.values()}
        assert len(shards) == 3, shards  # twelve queues over three shards: each gets some
