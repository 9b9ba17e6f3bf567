"""docs/OPERATIONS.md §11's recipe, run: a `poold` server and a `poold --worker`, each told only
`redis_cluster_nodes` (and the password), on a real Redis Cluster of three primaries with a
replica each, and `poolctl` against them: jobs in queues on every shard are accepted
(acknowledged once on a replica), run, and waited for; `ls` sees them all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from daemon.queue import keys
from tests.daemon.queue.test_cluster import queues_on_shards
from tests.support.cluster import ClusterGroup
from tests.support.poolctl import poolctl, researcher_env
from tests.support.poold_proc import poold
from tests.support.workers import JOBS_AS_ROOT

TOKENS = {"alice": "alice-token-0123456789abcdef"}


async def test_poolctl_on_a_pool_whose_redis_is_a_cluster(tmp_path: Path, s3_env: dict[str, str]) -> None:
    with ClusterGroup(tmp_path / "cluster", replicas=1) as cluster:
        names = queues_on_shards(cluster, 3)
        assert len({cluster.owner(cluster.keyslot(keys.stream(q))) for q in names}) == 3
        nodes = ",".join(p.address for p in cluster.processes())
        worker_env = {
            **os.environ,
            **s3_env,
            "GPUPOOL_WORKER_MODE": "multinode",
            "GPUPOOL_REDIS_CLUSTER_NODES": nodes,
            "GPUPOOL_MAIN_SERVER_REDIS_PASSWORD": cluster.password,
            "GPUPOOL_REDIS_MIN_REPLICAS_ACK": "1",
            "GPUPOOL_QUEUES": ",".join(names),
            "GPUPOOL_DATA_DIR": str(tmp_path / "worker"),
            "GPUPOOL_METRICS_LISTEN": "127.0.0.1:0",
            **JOBS_AS_ROOT,
        }
        argv = [sys.executable, "-m", "daemon.main", "--worker"]
        with (
            poold(cluster, tmp_path / "server", TOKENS, "--redis-min-replicas-ack", "1") as address,
            open(tmp_path / "worker.log", "wb") as log,
            subprocess.Popen(argv, env=worker_env, stderr=log) as worker,
        ):
            try:
                env = researcher_env(tmp_path, address, "alice", TOKENS["alice"])
                ids = []
                for q in names:
                    code, out, err = await poolctl(env, "enqueue", "--json", "-q", q, "--", "true")
                    assert code == 0, err
                    ids.append(json.loads(out)["id"])
                code, out, err = await poolctl(env, "wait", *ids)
                assert code == 0, (out, err, (tmp_path / "worker.log").read_text()[-2000:])
                code, out, err = await poolctl(env, "ls", "--all", "--json")
                assert code == 0, err
                listed = {job["id"]: job["state"] for job in map(json.loads, out.splitlines())}
                assert all(listed.get(i) == "succeeded" for i in ids), listed
            finally:
                worker.terminate()
                worker.wait(30)
