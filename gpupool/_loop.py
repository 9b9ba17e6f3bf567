"""The API's own event loop: one per process, in a daemon thread, never the caller's.

Every request to the pool runs as a coroutine on this loop, and the caller waits on a
`concurrent.futures.Future`: so the blocking API works where an event loop already runs (a Jupyter
kernel, a coroutine) without touching that loop, and a wait is a lock's wait, which Ctrl-C (SIGINT)
interrupts in the main thread. A process forked from one with the loop starts its own: the thread
does not survive a fork.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class _Running:
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    pid: int


_lock = threading.Lock()
_running: list[_Running] = []  # this process's, once started: at most one
STOP_SECONDS = 5.0  # at exit, the most the loop's thread is waited for
SETTLERS = 4  # threads that set futures' outcomes (and run their callbacks), started as needed
_settlers: list[tuple[concurrent.futures.ThreadPoolExecutor, int]] = []  # with the pid they belong to


def loop() -> asyncio.AbstractEventLoop:
    """The process's loop, started on first use (and again in a forked child)."""
    with _lock:
        if not _running or _running[0].pid != os.getpid():
            new = asyncio.new_event_loop()
            thread = threading.Thread(target=new.run_forever, name="gpupool-loop", daemon=True)
            thread.start()
            _running[:] = [_Running(new, thread, os.getpid())]
        return _running[0].loop


def on_loop() -> bool:
    """Whether the caller runs on the loop's own thread (where a blocking wait would never end)."""
    return bool(_running) and threading.current_thread() is _running[0].thread


def settle(fn: Callable[[], None]) -> None:
    """Run `fn` (a future's outcome being set) on one of the process's settling threads, never on
    the loop: the futures' done-callbacks run there, and may block (submit the next job, wait for
    one) as they could not on the loop."""
    with _lock:
        if not _settlers or _settlers[0][1] != os.getpid():
            _settlers[:] = [
                (
                    concurrent.futures.ThreadPoolExecutor(SETTLERS, thread_name_prefix="gpupool-settle"),
                    os.getpid(),
                )
            ]
        settlers = _settlers[0][0]
    try:
        settlers.submit(fn)
    except RuntimeError:  # the interpreter is exiting (its threads' pools shut down): here, then
        fn()


def stop() -> None:
    """Stop this process's loop and wait for its thread (at exit, every Pool closed)."""
    with _lock:
        if not _running or _running[0].pid != os.getpid():
            return
        running = _running.pop()

    async def end_tasks() -> None:  # each its `finally` (a watch closes its connection)
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    with contextlib.suppress(Exception):
        asyncio.run_coroutine_threadsafe(end_tasks(), running.loop).result(STOP_SECONDS)
    running.loop.call_soon_threadsafe(running.loop.stop)
    running.thread.join(STOP_SECONDS)
    if not running.thread.is_alive():
        running.loop.close()


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Run `coro` on the loop; its outcome comes in the Future returned."""
    return asyncio.run_coroutine_threadsafe(coro, loop())


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run `coro` on the loop and wait for its outcome (TimeoutError after `timeout` seconds).
    Ctrl-C interrupts the wait and cancels the coroutine."""
    if on_loop():
        coro.close()
        raise RuntimeError("a blocking gpupool call from inside gpupool's own loop would never return")
    future = submit(coro)
    try:
        return future.result(timeout)
    except (KeyboardInterrupt, concurrent.futures.TimeoutError):
        future.cancel()
        raise
