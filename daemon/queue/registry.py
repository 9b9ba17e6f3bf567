"""Who the workers are: their registration records, and the view `poolctl workers` shows.

A worker's record says what it is (host, pid, version, slots, GPUs, CPUs, memory, queues) and how
it is (healthy or draining, jobs running). Every heartbeat rewrites it (heartbeat.lua) together
with the worker's last-seen time, both in the pool-wide `{pool}` keys (daemon/queue/keys.py), the time
taken from Redis's own clock. `list_workers` compares that time with Redis's clock again, never
with the reader's, to say how long each worker has been silent; one silent for longer than its
healthy period (the lease it renews) is shown as dead.

Worker ids are `HOST-PID-RANDOM`: a pid is reused after a reboot or in another container on the
same host, and a worker that restarts must never be mistaken for the one that died, whose leases
are still being reclaimed.
"""

from __future__ import annotations

import importlib.metadata
import os
import secrets
import socket
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import psutil

from daemon.queue import keys
from daemon.queue.connection import AnyRedis
from daemon.queue.scripts import ScriptBatch, Scripts

HEALTHY = "healthy"
DRAINING = "draining"
LATE = "late"  # its heartbeats have stopped coming, for less than its healthy period so far
DEAD = "dead"
# Beats a worker may miss before it is shown late: two, and half a beat's grace for a slow one.
LATE_AFTER_BEATS = 2.5


def new_worker_id(host: str | None = None) -> str:
    """`HOST-PID-RANDOM` (6 hex digits): readable in `poolctl workers`, unique across restarts."""
    return f"{host or socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def agent_worker_id(host: str) -> str:
    """`HOST-agent-RANDOM` (16 hex digits): the worker the server runs for an agent (hosted.py);
    unlike `new_worker_id`'s, its end says what it is (`is_agent_worker`)."""
    return f"{host}-agent-{secrets.token_hex(8)}"


def version() -> str:
    try:
        return importlib.metadata.version("gpupool")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def batch_job(env: Mapping[str, str] | None = None) -> str:
    """The batch job this process runs in (a pilot worker, `poolctl pilot`): `slurm:ID` or
    `pbs:ID`, from the variables the scheduler sets; "" outside one."""
    env = os.environ if env is None else env
    if job := env.get("SLURM_JOB_ID"):
        return f"slurm:{job}"
    if job := env.get("PBS_JOBID"):
        return f"pbs:{job}"
    return ""


@dataclass(slots=True)
class Registration:
    """A worker's record. The worker updates `state`, `running` and `gpus` before each heartbeat."""

    id: str
    slots: int
    queues: Sequence[str]
    healthy_period: float  # seconds of silence after which the worker is dead (its lease length)
    heartbeat_every: float = 0.0  # seconds between its heartbeats (0: not said; a tenth of the above)
    gpus: list[dict[str, Any]] = field(default_factory=list)
    state: str = HEALTHY
    running: int = 0
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    version: str = field(default_factory=version)
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    memory: int = field(default_factory=lambda: psutil.virtual_memory().total)
    job_memory: int = 0  # bytes its jobs may have in all (--mem; worker/host.py); 0: not counted
    started_at: float = 0.0  # Unix time
    batch_job: str = field(default_factory=batch_job)  # the pilot's, else ""
    leave_by: float = 0.0  # Unix time by which it has left (worker_max_lifetime); 0.0: no end
    serves: str = ""  # the one pool user whose jobs it runs (worker_serve_user); "": every user's

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "host": self.host,
            "pid": self.pid,
            "version": self.version,
            "slots": self.slots,
            "running": self.running,
            "gpus": self.gpus,
            "cpus": self.cpus,
            "memory": self.memory,
            "job_memory": self.job_memory,
            "queues": list(self.queues),
            "state": self.state,
            "started_at": self.started_at,
            "healthy_period": self.healthy_period,
            "heartbeat_every": self.heartbeat_every,
            "batch_job": self.batch_job,
            "leave_by": self.leave_by,
            "serves": self.serves,
        }


def add_heartbeat(batch: ScriptBatch, scripts: Scripts, registration: Registration) -> int:
    """Add the registration refresh (heartbeat.lua) to `batch`; returns its reply's index."""
    return batch.add(
        scripts.heartbeat,
        [keys.WORKERS, keys.WORKERS_SEEN, keys.QUEUES],
        [registration.id, msgpack.packb(registration.to_dict()), *registration.queues],
    )


async def prune(redis: AnyRedis, scripts: Scripts, retention: float) -> list[str]:
    """Forget the workers silent for longer than `retention` seconds (prune_workers.lua); their ids."""
    gone = await scripts.prune_workers(keys=[keys.WORKERS, keys.WORKERS_SEEN], args=[round(retention * 1000)])
    return [_s(w) for w in gone]


async def unregister(redis: AnyRedis, worker_id: str) -> None:
    """Forget a worker that stopped cleanly (a dead one stays listed, as dead)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hdel(keys.WORKERS, worker_id)
        pipe.zrem(keys.WORKERS_SEEN, worker_id)
        await pipe.execute()


# The clock of the node that holds KEYS[1]: the heartbeats' times are that node's (heartbeat.lua).
# A script, where TIME itself would do on one node: a Cluster's pipeline sends a command without a
# key to any node, and refuses TIME outright.
CLOCK = "return redis.call('TIME')"


async def list_workers(redis: AnyRedis) -> list[dict[str, Any]]:
    """Every registered worker (`registered_workers`) with its `running`: what the queues know runs
    there (their leases), not what its last heartbeat said, which may be a heartbeat's period old.
    Sorted by host then id. Three round trips."""
    out = await registered_workers(redis)
    running = await running_by_worker(redis, sorted({q for r in out for q in r.get("queues") or ()}))
    for record in out:
        record["running"] = running.get(str(record.get("id")), 0)
    return out


async def registered_workers(redis: AnyRedis) -> list[dict[str, Any]]:
    """Every registered worker's record plus `last_heartbeat_age` (seconds, by Redis's clock; None
    if it never beat) and `health`: healthy or draining as it said; late when it has missed
    LATE_AFTER_BEATS of its heartbeats; dead when silent for longer than its healthy period. Its
    `running` as its last heartbeat said. Sorted by host then id. One round trip: what a check of
    what the workers serve needs, at every enqueue."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.WORKERS)
        pipe.zrange(keys.WORKERS_SEEN, 0, -1, withscores=True)
        pipe.eval(CLOCK, 1, keys.WORKERS_SEEN)
        records, seen, (seconds, micros) = await pipe.execute()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    last = {_s(member): float(score) for member, score in seen}
    out = []
    for worker_id, packed in records.items():
        record: dict[str, Any] = msgpack.unpackb(packed)
        seen_ms = last.get(_s(worker_id))
        age = max(0.0, (now_ms - seen_ms) / 1000) if seen_ms is not None else None
        record["last_heartbeat_age"] = age
        period = float(record.get("healthy_period", 300.0))
        beat = float(record.get("heartbeat_every") or period / 10)
        if age is None or age > period:
            record["health"] = DEAD
        elif age > LATE_AFTER_BEATS * beat:
            record["health"] = LATE
        else:
            record["health"] = str(record.get("state", HEALTHY))
        out.append(record)
    out.sort(key=lambda r: (str(r.get("host", "")), str(r.get("id", ""))))
    return out


async def running_by_worker(redis: AnyRedis, queues: Sequence[str]) -> dict[str, int]:
    """How many running attempts of `queues` each worker holds, by worker id: the queues' leases,
    each job's record naming its worker (two round trips)."""
    if not queues:
        return {}
    async with redis.pipeline(transaction=False) as pipe:
        for q in queues:
            pipe.zrange(keys.leases(q), 0, -1)
        leased = [_s(job_id) for ids in await pipe.execute() for job_id in ids]
    if not leased:
        return {}
    async with redis.pipeline(transaction=False) as pipe:
        for job_id in leased:
            pipe.hget(keys.job(job_id), "worker")
        holders = await pipe.execute()
    return Counter(_s(w) for w in holders if w)


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
