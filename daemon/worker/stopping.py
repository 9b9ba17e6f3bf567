"""How a worker stops: in two phases, as SAQ and uvicorn do. `stop()` first stops claiming and
lets running jobs finish for up to `drain_timeout` seconds; then it stops the rest (SIGTERM,
SIGKILL after `kill_grace`) and hands their attempts back to the front of their queues
(`JobQueue.hand_back`), so another worker takes them first. `force()` (a second signal) cuts the
wait short and kills at once; the attempts are still handed back. `stop()` is safe to call twice.
A Worker installs no signal handler: `main` does, for `WorkerDaemon` (worker mode) and the server
running local slots.

A claim that was in flight when the dispatcher ended is asked again, and what it got handed back
(`JobQueue.settle_claims`); jobs kept ahead of a free slot (fast_path.py) go back first, as they
never started.

`Stopping` is the stopping half of `dispatcher.Worker`, a mixin on the Worker's own books (as
queue/claims.py is to JobQueue), which declares here what of them it uses.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from daemon.aio import TaskSet, cancel_and_wait
from daemon.errors import NotReplicated
from daemon.job import Lease
from daemon.queue import registry
from daemon.worker.attempt import boottime

if TYPE_CHECKING:
    from daemon.queue.job_queue import JobQueue
    from daemon.queue.registry import Registration
    from daemon.worker.envs import EnvCache
    from daemon.worker.fast_path import LookAhead
    from daemon.worker.gpu_books import GpuBooks
    from daemon.worker.run_types import Run
    from daemon.worker.slots import Slots
    from storage.cache import ObjectCache

log = logging.getLogger(__name__)


class Stage(enum.Enum):
    """Where a worker is in its life; it only moves down this list."""

    WORKING = "working"  # claiming and running
    DRAINING = "draining"  # stop() began: no more claims, running jobs may finish
    HANDING_BACK = "handing back"  # the drain is over: the rest are stopped and handed back


class Stopping:
    """`stop()` and `force()` of a Worker (which sets these attributes)."""

    id: str
    queue: JobQueue
    drain_timeout: float
    cache: ObjectCache | None
    envs: EnvCache
    _stage: Stage
    _stopped: asyncio.Event
    _forced: asyncio.Event
    _wake: asyncio.Event
    _slot_freed: asyncio.Event
    _dispatcher: asyncio.Task[None] | None
    _attempts: TaskSet
    _background: TaskSet
    _ahead: LookAhead
    _registration: Registration
    _slots: Slots
    gpu_books: GpuBooks

    def _runs(self) -> list[Run]:
        raise NotImplementedError  # the Worker's

    def _hand_back(self, leases: Iterable[Lease], deadline: float) -> None:
        raise NotImplementedError  # the Worker's

    async def stop(self, drain_timeout: float | None = None) -> None:
        """Phase 1: stop claiming, let running jobs finish for up to `drain_timeout` seconds (the
        configured one by default). Phase 2: stop the rest and hand their attempts back. A second
        call waits for the first (with `drain_timeout=0` it forces it). If this coroutine is
        cancelled, the jobs are SIGKILLed at once and their leases left to expire."""
        if self._stage is not Stage.WORKING:
            if drain_timeout == 0:
                self.force()
            await self._stopped.wait()
            return
        self._stage = Stage.DRAINING
        try:
            await self._drain(self.drain_timeout if drain_timeout is None else drain_timeout)
            await self._hand_back_the_rest()
            await self._shutdown()
        except asyncio.CancelledError:
            for run in self._runs():
                run.lose("the worker was stopped at once")
            self._background.cancel()  # no more beats or claims: the leases are left to expire
            raise
        finally:
            self._stopped.set()

    def force(self) -> None:
        """End the drain now; stop jobs with SIGKILL instead of SIGTERM (a second signal)."""
        self._forced.set()
        if self._stage is Stage.HANDING_BACK:
            for run in self._runs():
                run.hand_back(now=True)

    async def _drain(self, grace: float) -> None:
        self._registration.state = registry.DRAINING
        self._wake.set()
        self._slot_freed.set()
        if self._dispatcher is not None:
            # It is in a claim (a short script call) or waiting, which the wake-up ends.
            done, _ = await asyncio.wait({self._dispatcher}, timeout=10)
            if not done:
                await cancel_and_wait(self._dispatcher)
        await self._settle_claims()
        for held in self._ahead.give_up():  # never started: back to the front first
            self._hand_back([held.lease], held.deadline)
        if not self._attempts:
            return
        log.info("draining: waiting up to %g s for %d running jobs", grace, len(self._attempts))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        forced = asyncio.ensure_future(self._forced.wait())
        try:
            while self._attempts and not self._forced.is_set() and loop.time() < deadline:
                await asyncio.wait(
                    {*self._attempts.tasks, forced},
                    timeout=deadline - loop.time(),
                    return_when=asyncio.FIRST_COMPLETED,
                )
        finally:
            forced.cancel()

    async def _settle_claims(self) -> None:
        """A claim whose reply never came (the dispatcher was cancelled in it, or Redis went away):
        ask again for what it got, and give that back at once, rather than leave those jobs to
        wait for their leases to expire."""
        try:
            leases = await self.queue.settle_claims(self.id)
        except (RedisError, NotReplicated) as exc:
            log.warning(
                "could not learn what an unanswered claim got (%s); its jobs wait for their leases", exc
            )
            return
        if leases:
            self._hand_back(leases, boottime())

    async def _hand_back_the_rest(self) -> None:
        self._stage = Stage.HANDING_BACK
        running = self._runs()
        if running:
            log.info("stopping %d running jobs; their attempts go back to the queue", len(running))
        for run in running:
            run.hand_back(now=self._forced.is_set())
        if self._attempts:
            await asyncio.wait(self._attempts.tasks)

    async def _shutdown(self) -> None:
        await self._background.stop()
        try:
            await registry.unregister(self.queue.redis, self.id)
        except RedisError as exc:
            log.warning("could not unregister worker %s (%s); it will show as dead", self.id, exc)
        await self.envs.close()  # (its builds sweep the builder's uid with the slots' spawner)
        await self._slots.close()
        if self.cache is not None:
            await self.cache.close()
        await self.gpu_books.close()
        log.info("worker %s stopped", self.id)
