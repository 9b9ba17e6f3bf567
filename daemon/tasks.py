"""Background tasks owned by whoever starts them: spawned into a set, cancelled and awaited on stop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


class TaskSet:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("background task %s died: %r", task.get_name(), exc, exc_info=exc)

    async def stop(self) -> None:
        """Cancel every task and wait until all have ended. A task whose cancellation was swallowed
        on the way (some client libraries absorb a CancelledError that lands inside their I/O) is
        cancelled again until it ends, so stop() never hangs on it."""
        while self._tasks:
            pending = list(self._tasks)
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=0.2)
