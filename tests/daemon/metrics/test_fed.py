"""Every series the daemons export is fed: each recording method of ServerMetrics and WorkerMetrics
is called by the daemon, and a real job on a real worker moves the worker's counters (a job start,
the bytes of its input coming down and of its artifacts and log going up)."""

from __future__ import annotations

import ast
import hashlib
import inspect
import os
from pathlib import Path

from daemon.job import JobSpec, JobState
from daemon.metrics.server import ServerMetrics
from daemon.metrics.worker import WorkerMetrics
from daemon.queue.job_queue import JobQueue
from storage.content import content_key
from storage.local import LocalStore
from tests.support.paths import ROOT
from tests.support.workers import running_worker, wait_state

# Called by the endpoint or by the refresh, not by whoever feeds the metrics.
NOT_RECORDING = {"watch", "refresh"}


def _recording_methods(cls: type) -> set[str]:
    return {
        name
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_") and name not in NOT_RECORDING
    }


def _fed_names() -> set[str]:
    """Every `<...>metrics.NAME` the daemon outside metrics/ touches (a call or a bound method handed
    on), and every `self.NAME` metrics/ calls on itself (the refresh sets what it read)."""
    fed: set[str] = set()
    daemon = ROOT / "daemon"
    for path in daemon.rglob("*.py"):
        inside = path.is_relative_to(daemon / "metrics")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name == "metrics" or (inside and name == "self"):
                fed.add(node.attr)
    return fed


def test_every_recording_method_is_called_by_the_daemon() -> None:
    """A series exported but never fed reads 0 for ever and misleads whoever alerts on it."""
    fed = _fed_names()
    for cls in (ServerMetrics, WorkerMetrics):
        unfed = _recording_methods(cls) - fed
        assert not unfed, f"{cls.__name__} exports series nothing feeds: {sorted(unfed)}"


async def test_a_real_job_moves_the_started_and_transfer_counters(queue: JobQueue, tmp_path: Path) -> None:
    data = os.urandom(300_000)
    async with LocalStore(tmp_path / "store") as store:
        info = await store.put_bytes(content_key(sha := hashlib.sha256(data).hexdigest()), data)
        assert info.size == len(data)
        script = 'cat in/data.bin > "$GPUPOOL_OUTPUT/copy"; echo done'
        spec = JobSpec(
            argv=("sh", "-c", script), inputs=({"sha256": sha, "dest": "in/data.bin", "kind": "file"},)
        )
        async with running_worker(queue, tmp_path / "w", store=store, slots=1) as worker:
            get = worker.metrics.registry.get_sample_value
            assert get("gpupool_transfer_bytes_total", {"direction": "download"}) == 0
            jobs = [(await queue.enqueue(spec))[0] for _ in range(2)]
            ended = [await wait_state(queue, job_id, JobState.SUCCEEDED, JobState.FAILED) for job_id in jobs]
            assert [e.state for e in ended] == [JobState.SUCCEEDED] * 2, [e.detail for e in ended]
            assert get("gpupool_jobs_started_total", {"queue": "default"}) == 2
            # Downloaded once: the second job's input came from the worker's cache, and no byte
            # crossed for it.
            assert get("gpupool_transfer_bytes_total", {"direction": "download"}) == len(data)
            uploaded = sum(a["size"] for e in ended for a in e.result["artifacts"])
            uploaded += sum(e.result["log"]["size"] for e in ended)
            assert uploaded > 2 * len(data)
            assert get("gpupool_transfer_bytes_total", {"direction": "upload"}) == uploaded
