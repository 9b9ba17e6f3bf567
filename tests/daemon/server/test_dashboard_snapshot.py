"""The pool view the dashboard's viewers share (server/web/snapshot.py), on a real Redis."""

from __future__ import annotations

from typing import Any

from daemon.queue.job_queue import JobQueue
from daemon.server.web.snapshot import Snapshots


async def test_a_gpus_readings_are_kept_while_its_worker_is_listed_and_dropped_after(queue: JobQueue) -> None:
    listed: list[dict[str, Any]] = []

    async def workers() -> list[dict[str, Any]]:
        return listed

    snapshots = Snapshots(queue, workers, max_age=0.0)
    for at in (1.0, 2.0, 2.0, 3.0):  # a reading seen twice is kept once
        listed[:] = [{"id": "w1", "gpus": [{"uuid": "GPU-a", "read_at": at, "utilization": at / 4}]}]
        snap = await snapshots.get()
    assert [r.at for r in snap.history["GPU-a"]] == [1.0, 2.0, 3.0]
    listed[:] = []  # the worker left (a pilot's end): its GPUs leave the charts with it
    assert (await snapshots.get()).history == {}
