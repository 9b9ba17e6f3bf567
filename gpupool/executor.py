"""`pool.executor(**options)`: the pool as a `concurrent.futures.Executor`, for code written
against one (ThreadPoolExecutor, ProcessPoolExecutor): `submit` returns a gpupool.Job, `map`
sends one array and yields its results in order."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from gpupool.errors import BadArgument
from gpupool.job import Job
from gpupool.options import Options

if TYPE_CHECKING:
    from gpupool.pool import Pool


class PoolExecutor(concurrent.futures.Executor):
    """Every job with the same `options`. `shutdown(wait=True)` waits for the jobs it submitted;
    `cancel_futures=True` cancels those not ended. The pool's connection stays open: it is the
    Pool's to close."""

    def __init__(self, pool: Pool, options: Options) -> None:
        self.pool = pool
        self.options = options
        self._jobs: list[Job] = []
        self._shut = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Job:
        if self._shut:
            raise RuntimeError("cannot submit after shutdown")
        job = self.pool.submit_with(self.options, fn, args, kwargs)
        self._jobs.append(job)
        return job

    def map(  # the results, as Executor.map's; the Jobs: pool.map
        self,
        fn: Callable[..., Any],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
    ) -> Iterator[Any]:
        if self._shut:
            raise RuntimeError("cannot submit after shutdown")
        if not iterables:
            raise BadArgument("map needs at least one iterable")
        jobs = self.pool.map_with(self.options, fn, [(args, {}) for args in zip(*iterables, strict=False)])
        self._jobs += jobs
        deadline = None if timeout is None else time.monotonic() + timeout

        def results() -> Iterator[Any]:
            for job in jobs:
                yield job.result(None if deadline is None else max(0.0, deadline - time.monotonic()))

        return results()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._shut = True
        if cancel_futures:
            for job in self._jobs:
                job.cancel()
        if wait:
            concurrent.futures.wait(self._jobs)
