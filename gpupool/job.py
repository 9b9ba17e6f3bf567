"""`gpupool.Job`: a job in the pool as a `concurrent.futures.Future`.

It works with `concurrent.futures.wait` and `as_completed`, and `await job` works in asyncio code.
It is told that its job ended by the process's one watch over the jobs of its pool
(gpupool/watch.py), never by a connection of its own. The outcome is set off the API's loop (its
done-callbacks may block), as the verified bytes the job left: they are unpickled in the thread
that asks for the result, once. A Ctrl-C during `result()` stops the wait, not the job: it runs on in
the pool, and `pool.job(job.id)` (in this process or another) waits for it again.
"""

from __future__ import annotations

import asyncio
import codecs
import concurrent.futures
import queue
import threading
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from daemon.job import TERMINAL_STATES
from gpupool import _loop
from gpupool.errors import Error
from gpupool.shipping import Fetched
from protocol import CancelJobs, Cancelled, FollowLogs, JobDetail, LogChunk, ShowJob

if TYPE_CHECKING:
    from gpupool.pool import Pool

_END = object()  # the end of a followed log, in its queue


class Job(concurrent.futures.Future[Any]):
    """A job of `pool`, by its id. `result()` is what its function returned (a command's job: its
    exit status, 0), or raises: the function's own exception, with the job's traceback as its
    cause; gpupool.JobFailed when the job ended without a result; CancelledError after `cancel()`.
    Ctrl-C interrupts `result()` and `exception()`, and stops only the wait: the job goes on in the
    pool, and `pool.job(job.id)` waits for it again."""

    def __init__(self, pool: Pool, job_id: str) -> None:
        super().__init__()
        self.pool = pool
        self.id = job_id
        self._loading = threading.Lock()
        self._loaded: tuple[bool, Any] | None = None  # (raised, what) once its bytes were loaded

    def result(self, timeout: float | None = None) -> Any:
        """What the job's function returned, or raises (the class's docstring says what)."""
        got = super().result(timeout)
        if not isinstance(got, Fetched):
            return got
        raised, what = self._load(got)
        if raised:
            raise what
        return what

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The exception `result()` raises, or None."""
        error = super().exception(timeout)
        if error is not None:
            return error
        got = super().result(0)
        if not isinstance(got, Fetched):
            return None
        raised, what = self._load(got)
        return what if raised else None

    def _load(self, fetched: Fetched) -> tuple[bool, Any]:
        """The outcome's bytes unpickled, once, in the caller's thread (never the API's loop)."""
        with self._loading:
            if self._loaded is None:
                try:
                    self._loaded = (False, fetched.load())
                except Exception as exc:  # noqa: BLE001 - the function's own exception, or ours
                    self._loaded = (True, exc)
            return self._loaded

    def __repr__(self) -> str:
        return f"<gpupool.Job {self.id} {self._state.lower()}>"  # the future's state: no request

    @property
    def state(self) -> str:
        """The job's state in the pool now (queued, running, succeeded, failed, cancelled, dead),
        asked of the server."""
        return str(self.record()["state"])

    def record(self) -> dict[str, Any]:
        """The job's record as the pool holds it (`poolctl show --json`'s)."""
        return self.pool.call(ShowJob(self.id), JobDetail).job

    def cancel(self) -> bool:
        """Cancel the job in the pool (a running one is stopped with its stop signal); True when it
        was cancelled, and this future with it. False when it had ended (or this future was done)."""
        if self.done():
            return False
        state = self.pool.call(CancelJobs([self.id]), Cancelled).states.get(self.id)
        if state not in ("cancelled", "cancelling"):
            return False
        self.pool.forget(self.id)
        return super().cancel()

    @overload
    def logs(self, follow: Literal[False] = False) -> str: ...

    @overload
    def logs(self, follow: Literal[True]) -> Iterator[str]: ...

    def logs(self, follow: bool = False) -> str | Iterator[str]:
        """The job's output so far, as text; with `follow`, an iterator of its output as it comes,
        until the job ends (one that has ended gives its whole log)."""
        if not follow:
            return "".join(self._follow(False))
        return self._follow(True)

    def _follow(self, follow: bool) -> Iterator[str]:
        chunks: queue.Queue[object] = queue.Queue()

        async def stream() -> None:
            try:
                client = await self.pool.client()
                async for item in client.stream(FollowLogs(self.id, follow, "")):
                    if isinstance(item, LogChunk):
                        chunks.put(item.data)
            except BaseException as exc:  # noqa: BLE001 - handed to the reader, who raises it
                chunks.put(exc)
            finally:
                chunks.put(_END)

        running = _loop.submit(stream())
        return _text(chunks, running)

    def artifacts(self, dest: str | Path) -> list[Path]:
        """Download the files the job left in $GPUPOOL_OUTPUT (and its log, as JOB.log) under
        `dest` (made if missing), each checked against the sha256 the worker recorded; the paths
        written. The job must have ended."""
        from daemon.ctl import transfer

        async def fetch() -> list[tuple[str, int]]:
            client = await self.pool.client()
            record = (await client.call(ShowJob(self.id), JobDetail)).job
            if record["state"] not in TERMINAL_STATES:
                raise Error(f"job {self.id} has not ended ({record['state']}): no artifacts yet")
            return await transfer.get_artifacts(client, record, Path(dest))

        return [Path(path) for path, _ in _loop.run(fetch())]

    def __await__(self) -> Generator[Any, None, Any]:
        """`await job`: its result, in asyncio code. The awaiting task cancelled (a timeout of
        `asyncio.wait_for`) cancels the job too, as a Future's waiter does."""
        return asyncio.wrap_future(self).__await__()


def _text(chunks: queue.Queue[object], running: concurrent.futures.Future[None]) -> Iterator[str]:
    """The log's bytes from `chunks` as text; the stream stops if the reader stops early."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        while (item := chunks.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, bytes)
            if text := decoder.decode(item):
                yield text
        if tail := decoder.decode(b"", final=True):
            yield tail
    finally:
        running.cancel()
