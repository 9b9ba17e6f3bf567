"""Small asyncio helpers: reliable cancellation, and background tasks owned by whoever starts them.

`cancel_and_wait` exists because a cancellation can be lost on Python 3.11: `asyncio.wait_for`,
which redis-py uses while it connects and reads, returns the result instead of raising
CancelledError when the operation it guards completes in the same loop iteration as the cancel
(CPython gh-86296, fixed in 3.12). A task cancelled once may then run on, for example into a
blocking XREAD; cancelling again until it has ended is what makes stopping it reliable.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

RECANCEL_SECONDS = 0.05


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel `task` (again, should a cancellation be lost) until it has ended. Its own outcome
    (result, exception or cancellation) is left in it for the caller to inspect."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_SECONDS)


async def woken_or(event: asyncio.Event, seconds: float) -> None:
    """Wait `seconds`, or less if `event` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()


async def start_or_undo(start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]) -> None:
    """`await start()`; if it fails (or is cancelled) part-way, `await stop()` before the error goes
    on, so that a failed start leaves no task, socket or process behind. `stop` must cope with a
    start that got anywhere."""
    try:
        await start()
    except BaseException:
        await stop()
        raise


class TaskSet:
    """Background tasks spawned into a set, logged if they die, cancelled and awaited on stop."""

    def __init__(self, died: str = "background task %s died", level: int = logging.ERROR) -> None:
        """`died` (with the task's name for %s) is logged at `level` when a task fails."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._died = died
        self._level = level

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    @property
    def tasks(self) -> frozenset[asyncio.Task[Any]]:
        """The tasks running now (a copy: to wait for)."""
        return frozenset(self._tasks)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.log(self._level, self._died + ": %r", task.get_name(), exc, exc_info=exc)

    def cancel(self) -> None:
        """Cancel every task without waiting (for a caller that is itself being cancelled)."""
        for task in self._tasks:
            task.cancel()

    async def stop(self) -> None:
        """Cancel every task and wait until all have ended (see `cancel_and_wait`)."""
        await asyncio.gather(*(cancel_and_wait(task) for task in list(self._tasks)))


def in_daemon_thread(call: Callable[[], T], name: str) -> asyncio.Future[T]:
    """Run `call` in a daemon thread of its own; its outcome comes back in the future. For calls
    that may hang for good (NVML on a failing GPU). Not asyncio.to_thread: a hung call would hold
    a thread of the default executor, which the event loop's own blocking calls (getaddrinfo)
    share, and asyncio.run waits for it at the exit, so the daemon would never exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():
            outcome()

    def run() -> None:
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 - handed to whoever awaits the future
            outcome = functools.partial(future.set_exception, exc)
        else:
            outcome = functools.partial(future.set_result, result)
        with contextlib.suppress(RuntimeError):  # the loop closed while the call hung
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
