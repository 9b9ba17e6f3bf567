"""Every retained job of the pool in a line each, for the dashboard's pool page and job list.

`job_rows` reads each queue's index of retained jobs (`keys.jobs`) and then a few fields of every
job in pipelined chunks: what a list shows (who, what, where, when, how it ended), never its
environment, inputs or result, and its name and command cut as every listing cuts them
(daemon/listing.py). It is a glance, not a snapshot: jobs move while it reads. The dashboard
reads it at most once every few seconds for all its viewers (server/web/snapshot.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import msgpack

from daemon.listing import LIST_ITEMS, cut
from daemon.queue import keys
from daemon.queue.connection import AnyRedis
from daemon.queue.reads import _s, _seconds

CHUNK = 1000  # job records asked for in one pipeline
FIELDS = ("id", "state", "user", "spec", "enqueued_at", "started_at", "ended_at", "exit_code", "worker")


@dataclass(frozen=True, slots=True)
class JobRow:
    """One job as a list shows it. Times are Unix seconds (None: not yet)."""

    id: str
    queue: str
    state: str
    user: str
    name: str
    command: str
    gpus: int
    enqueued_at: float
    started_at: float | None
    ended_at: float | None
    exit_code: int | None
    worker: str


async def job_rows(redis: AnyRedis, queues: list[str]) -> list[JobRow]:
    """The retained jobs of `queues`, oldest first by enqueue time."""
    rows: list[JobRow] = []
    for queue in queues:
        ids = [_s(i) for i in cast(list[bytes], await redis.zrange(keys.jobs(queue), 0, -1))]
        for start in range(0, len(ids), CHUNK):
            async with redis.pipeline(transaction=False) as pipe:
                for job_id in ids[start : start + CHUNK]:
                    pipe.hmget(keys.job(job_id), FIELDS)
                for values in await pipe.execute():
                    if values[0] is not None:  # past retention: gone between the two reads
                        rows.append(_row(queue, values))
    rows.sort(key=lambda r: r.enqueued_at)
    return rows


def _row(queue: str, values: list[bytes | None]) -> JobRow:
    job_id, state, user, spec, enqueued, started, ended, exit_code, worker = values
    data = msgpack.unpackb(spec) if spec else {}
    argv = data.get("argv") or ()
    return JobRow(
        id=_s(job_id or b""),
        queue=queue,
        state=_s(state or b""),
        user=cut(_s(user or b"") or str(data.get("user", ""))),
        # cut as every listing cuts them (daemon/listing.py): one user's long names cannot make
        # the job list too large to draw for everyone
        name=cut(str(data.get("name") or "")),
        command=cut(" ".join(str(a) for a in argv[:LIST_ITEMS])),
        gpus=int(data.get("gpus") or 0),
        enqueued_at=int(enqueued or 0) / 1000,
        started_at=_seconds(started),
        ended_at=_seconds(ended),
        exit_code=int(exit_code) if exit_code else None,
        worker=_s(worker or b""),
    )
