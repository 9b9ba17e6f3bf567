"""What Redis says of the scheduler's model's queue after a step (scheduler_model.py, issue 46):
each job's record and places, its terminal events, the queue's reservation, Redis's clock; and
the queue's keys that still hold something once every job ended."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from daemon.queue import keys
from daemon.queue.connection import AnyRedis
from tests.support.queue_places import places

# Keys that must be empty once every job of the queue has ended.
EMPTY_AT_END: tuple[Callable[[str], str], ...] = (
    keys.front,
    keys.backoff,
    keys.parked,
    keys.capped,
    keys.capped_users,
    keys.priority,
    keys.waiting,
    keys.leases,
    keys.unended,
)


async def leftovers(redis: AnyRedis, queue: str) -> dict[str, int]:
    """The queue's keys that still hold something, with how much: none once all jobs ended."""
    pipe = redis.pipeline(transaction=False)
    for key in EMPTY_AT_END:
        pipe.type(key(queue))
    pipe.xlen(keys.stream(queue))
    kinds = await pipe.execute()
    out = {}
    for key, kind in zip(EMPTY_AT_END, kinds[:-1], strict=True):
        if kind != b"none":
            out[key(queue)] = 1
    if kinds[-1]:
        out[keys.stream(queue)] = int(kinds[-1])
    return out


RECORD_FIELDS = ("state", "attempt", "worker", "lease", "held_gpus", "gpu_mem_bytes", "shared_gpu", "user")


@dataclass
class Snapshot:
    """What Redis says after a step: each job's record and places, its terminal events, the
    queue's reservation, and Redis's clock."""

    records: dict[str, dict[str, str]]
    places: dict[str, list[str]]
    ends: Counter[str]
    reservation: dict[str, str]
    now_ms: int

    @classmethod
    async def read(cls, redis: AnyRedis, queue: str, ids: list[str]) -> Snapshot:
        found = await places(redis, queue, ids)
        pipe = redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(keys.job(job_id), *RECORD_FIELDS)
        pipe.xrange(keys.events(queue), "-", "+")
        pipe.hgetall(keys.reservation(queue))
        *rows, events, reservation = await pipe.execute()
        sec, usec = await redis.time()  # (apart: a Cluster's pipeline takes no command without a key)
        records = {
            job_id: {f: text(v) for f, v in zip(RECORD_FIELDS, row, strict=True)}
            for job_id, row in zip(ids, rows, strict=True)
        }
        ends = Counter(text(fields[b"job"]) for _id, fields in events)
        held = {text(k): text(v) for k, v in reservation.items()}
        return cls(records, found, ends, held, int(sec) * 1000 + int(usec) // 1000)

    def users(self) -> Iterator[tuple[str, int, int]]:
        """Each user running jobs in the queue: (user, jobs, GPUs held)."""
        jobs: Counter[str] = Counter()
        gpus: Counter[str] = Counter()
        for r in self.records.values():
            if r["state"] == "running":
                jobs[r["user"]] += 1
                gpus[r["user"]] += int(r["held_gpus"])
        for user, n in jobs.items():
            yield user, n, gpus[user]

    def under_cap(self, user: str, need: int, caps: tuple[int, int]) -> bool:
        """Whether `user` may start one more job of `need` GPUs (claim.lua's rule, §4)."""
        most_jobs, most_gpus = caps
        for name, n, gpus in self.users():
            if name == user:
                return (most_jobs == 0 or n < most_jobs) and (most_gpus == 0 or gpus + need <= most_gpus)
        return True

    def check_caps(self, caps: tuple[int, int]) -> None:
        most_jobs, most_gpus = caps
        for user, n, gpus in self.users():
            if n >= 2:
                assert most_jobs == 0 or n <= most_jobs, f"{user} runs {n} jobs, over the cap of {most_jobs}"
                assert most_gpus == 0 or gpus <= most_gpus, f"{user} holds {gpus} GPUs, over {most_gpus}"


def text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else value or ""
