"""Asking NVML about a GPU within a bound: the one way the worker does it.

NVML calls block, and on a failing GPU (its driver stopped answering, as with a GPU falling off the
bus) one may hang for good. So each ask about a GPU runs in a daemon thread of its own
(daemon.aio.in_daemon_thread: a hung one holds that thread alone, never the default executor, nor
the exit), and the asker waits NVML_READ_SECONDS at most for it. An ask left unanswered is kept:
the GPU is not asked again until it answers (a GPU that hangs holds one thread per asker, not one
per pass), and how long it has gone unanswered is what says the GPU is hung (`Ask.hung`), not one
slow answer: a driver lock held a few seconds (a big CUDA context's teardown, `nvidia-smi -q`)
delays every ask and is no fault.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from daemon.aio import in_daemon_thread

T = TypeVar("T")

# How long one wait for NVML's answer about a GPU lasts: a sound GPU answers in milliseconds.
NVML_READ_SECONDS = 5.0
# How long an ask may go unanswered before its GPU counts as hung (the health fault `hung`),
# counted from when it was asked: longer than any driver lock a sound GPU is held by.
HUNG_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class Ask(Generic[T]):
    """One ask about a GPU: its answer in `answer` once done (a result or NVML's error), and when
    it was asked (time.monotonic())."""

    answer: asyncio.Future[T]
    since: float

    def hung(self, now: float) -> bool:
        """Unanswered for HUNG_SECONDS at `now` (time.monotonic())."""
        return not self.answer.done() and now - self.since >= HUNG_SECONDS


class GpuAsks(Generic[T]):
    """One asker's asks about its GPUs, at most one pending per GPU; `name` names their threads.
    Not thread-safe: the worker's event loop owns it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._pending: dict[str, Ask[T]] = {}

    async def ask(
        self,
        calls: Mapping[str, Callable[[], T]],
        seconds: float = NVML_READ_SECONDS,
        *,
        wait_pending: bool = False,
    ) -> dict[str, Ask[T]]:
        """Ask each GPU of `calls` (by UUID) its call, each in a thread of its own, and wait for
        the answers `seconds` at most. A GPU whose earlier ask (this asker's or another's) is
        still unanswered is not asked again: its ask is returned as it is (an answer that came
        since is taken, older than a fresh one but its own), waited for only with `wait_pending`
        (a pass does not wait again on a GPU that hangs; a job's end check waits for a read a
        pass asked a moment before). Each GPU's ask comes back, done or not; one not done is
        kept, to be returned until it is. Askers share the asks: whichever sees an ask answered
        first lets it go, and the others still get it."""
        now = time.monotonic()
        asks: dict[str, Ask[T]] = {}
        waited = []
        for uuid, call in calls.items():
            if (ask := self._pending.get(uuid)) is None:
                ask = self._pending[uuid] = Ask(in_daemon_thread(call, self._name), now)
                waited.append(ask.answer)
            elif wait_pending:
                waited.append(ask.answer)
            asks[uuid] = ask
        if waited:
            await asyncio.wait(waited, timeout=seconds)
        for uuid, ask in asks.items():
            if ask.answer.done() and self._pending.get(uuid) is ask:
                del self._pending[uuid]
        return asks


async def bounded(call: Callable[[], T], name: str, seconds: float) -> T:
    """`call` (one that may hang on NVML, not about one GPU: its start or its close) in a daemon
    thread of its own, waited for `seconds` at most (TimeoutError; the thread is left to finish or
    die with the process)."""
    return await asyncio.wait_for(in_daemon_thread(call, name), seconds)
