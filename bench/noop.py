"""The bench's no-op executor: a real `Worker` (dispatcher, claims, heartbeat, completes) whose
attempts run no process and succeed at once. It measures the queue and the dispatch path alone."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from daemon.job import JobState, Lease, Outcome
from daemon.queue.job_queue import JobQueue
from daemon.worker.dispatcher import Worker
from daemon.worker.gpus import GpuInfo
from daemon.worker.run_types import Ending, RunResult

DONE = RunResult(Ending.EXITED, Outcome(JobState.SUCCEEDED, exit_code=0))


class NoopRun:
    """One attempt that does nothing; `started` gets its start time (monotonic) by job id."""

    def __init__(self, lease: Lease, gpus: tuple[GpuInfo, ...], started: dict[str, float]) -> None:
        self.lease = lease
        self.gpus = gpus
        self._started = started
        self.exited = False

    def start(self) -> None:
        pass  # it starts in `run`, as a job with data to fetch first does

    async def run(self) -> RunResult:
        self._started[self.lease.job_id] = time.monotonic()
        self.exited = True
        return DONE

    @property
    def stopping(self) -> bool:
        return self.exited

    def cancel(self) -> None:
        pass

    def hand_back(
        self, now: bool = False, why: str = "the worker is stopping", by_policy: bool = False
    ) -> None:
        pass

    def lose(self, why: str) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    async def tidy(self) -> None:
        pass


def record_completions(queue: JobQueue, done: dict[str, float]) -> None:
    """Instrument `queue` so that `done` gets the time (monotonic) each `complete` returned."""
    complete: Callable[..., Awaitable[Any]] = queue.complete

    async def timed(lease: Lease, *args: Any, **kwargs: Any) -> Any:
        result = await complete(lease, *args, **kwargs)
        done[lease.job_id] = time.monotonic()
        return result

    queue.complete = timed  # type: ignore[method-assign]


def noop_worker(
    queue: JobQueue, data_dir: Path, queue_name: str, slots: int, started: dict[str, float]
) -> Worker:
    """A Worker on `queue_name` with `slots` slots, no GPUs, and the no-op executor."""
    return Worker(
        queue,
        data_dir=data_dir,
        slots=slots,
        queues=[queue_name],
        gpus=[],
        make_run=lambda lease, gpus, _slot: NoopRun(lease, gpus, started),
    )
