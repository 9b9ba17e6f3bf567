"""How long a connection's read loop may wait for its next bytes, watched by one timer.

A timeout context around each read (`asyncio.timeout`) makes a timer when the read starts and
cancels it when the bytes come: for a request that arrives after an idle spell, time of the
server's on the path to its answer (and to a job's start), before the request's own task runs.
Here a read only notes when it started, and sets the timer again only if its deadline came
nearer than the timer (the handshake's deadline gave way to a shorter idle timeout). The timer,
when it fires, looks at the deadline as it stands now (the current read's): not reached yet, it
sets itself again for it; reached with the read still waiting, it cancels the read, which then
raises TimeoutError, as the context did. A timer that fires between reads lapses, and the next
read sets a new one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class IdleWatch:
    """`await watch.read(reader, n)`: `reader.read(n)`, raising TimeoutError once it has waited
    past `deadline(started)` (loop time; `started`: when the read began). Made and used in the
    read loop's own task; `close()` once the loop is over."""

    def __init__(self, deadline: Callable[[float], float]) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None, "an IdleWatch is made in the task that reads"
        self._task = task
        self._deadline = deadline
        self._started = 0.0  # when the current (or the last) read began
        self._reading = False
        self._expired = False  # the watch cancelled the read (not someone else)
        self._handle: asyncio.TimerHandle | None = None
        self._closed = False

    async def read(self, reader: asyncio.StreamReader, n: int) -> bytes:
        self._started = self._loop.time()
        if not self._closed:
            deadline = self._deadline(self._started)
            if self._handle is None or self._handle.when() > deadline:
                if self._handle is not None:  # the deadline came nearer (the handshake finished)
                    self._handle.cancel()
                self._handle = self._loop.call_at(deadline, self._look)
        cancelling = self._task.cancelling()
        self._reading = True
        try:
            return await reader.read(n)
        except asyncio.CancelledError:
            if self._expired:
                self._expired = False
                if self._task.uncancel() <= cancelling:  # no one else asked the task to stop
                    raise TimeoutError from None
            raise
        finally:
            self._reading = False

    def _look(self) -> None:
        self._handle = None
        if not self._reading:
            return  # lapsed: the next read sets it again
        deadline = self._deadline(self._started)
        if self._loop.time() < deadline:
            self._handle = self._loop.call_at(deadline, self._look)
        else:
            self._expired = True
            self._task.cancel()

    def close(self) -> None:
        self._closed = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
