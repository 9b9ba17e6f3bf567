"""An agent's beats: how it keeps the server's worker for it alive, and its attempts' deadlines
moved (docs/PROTOCOL.md §3.4).

The agent calls `beat` every `beat_seconds` (the hello says it), and at once when a job is ordered
run; each answer says, per lease, how many seconds it still holds, which the server counts from
when the beat came and the agent from when it sent it, which is before: sound whatever the
delays. A `run` order's own `valid_for` is provisional (counted from when the order came, which
may have waited in the server's queue or on the connection): the first answer for that attempt
sets its deadline, earlier too; later answers only move it on. The fence (attempt.Holdings) kills
an attempt whose deadline passes, and the orphan guard holds the same deadlines, should the agent
be frozen.

A beat unanswered in `beat_seconds` failed; once none has been answered for a lease, the server's
worker for this agent has abandoned it, or will before the agent could hear so: the beats stop and
say so (`silent`), and the agent ends its serve, which kills every job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping

from daemon.client.pool_client import ClientError
from daemon.worker.attempt import Holdings, boottime
from daemon.worker.pool_link import PoolUnreachable
from daemon.worker.relay import AgentCalls

log = logging.getLogger(__name__)


class Beats:
    """The beat loop of one serve (`run()`), from the hello on: `expect()` each attempt ordered
    run, `forget()` it once its slot is tidied. `over()` says when the serve has ended (the loop
    then returns); `silent(why)` is awaited once no beat has been answered for a lease."""

    def __init__(
        self,
        calls: AgentCalls,
        held: Holdings,
        *,
        beat_seconds: float,
        lease_seconds: float,
        over: Callable[[], bool],
        silent: Callable[[str], Awaitable[None]],
    ) -> None:
        self._calls = calls
        self._held = held
        self.beat_seconds = beat_seconds
        self.lease_seconds = lease_seconds
        self._over = over
        self._silent = silent
        self._now = asyncio.Event()
        self._provisional: set[str] = set()  # leases whose deadline is still their run order's

    def expect(self, lease_id: str) -> None:
        """An attempt ordered run: its deadline is its order's until the next answer, asked now."""
        self._provisional.add(lease_id)
        self._now.set()

    def forget(self, lease_id: str) -> None:
        """An attempt whose slot is tidied: no answer may set its deadline any more."""
        self._provisional.discard(lease_id)

    async def run(self) -> None:
        """Call `beat` every beat_seconds, and at once when a job is ordered run, until the serve
        is over: each answer moves the deadlines from when its beat was sent. Once none has been
        answered for a lease, `silent` is told why, and the beats stop."""
        answered = boottime()  # the hello: its worker counts it as a beat
        failing = False
        while not self._over():
            self._now.clear()
            sent = boottime()
            try:
                answer = await self._calls.call("", "beat", within=self.beat_seconds)
                valid_for = {str(k): float(v) for k, v in answer["valid_for"].items()}
            except (KeyError, TypeError, ValueError, AttributeError) as exc:  # the server's bug: said
                log.error("the pool server's answer to beat is malformed (%r); taken as none", exc)
                failing = True
            except (PoolUnreachable, ClientError) as exc:
                if self._over():
                    return
                if not failing:
                    log.warning("beat unanswered (%s); jobs are killed if none is answered in time", exc)
                failing = True
            else:
                if failing:
                    log.info("beats answered again after %.1f s", boottime() - answered)
                answered, failing = sent, False
                self._renewed(valid_for, sent)
            if (silent := boottime() - answered) >= self.lease_seconds:
                await self._silent(f"no beat answered by the pool server for {silent:.1f} s, a lease")
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, sent + self.beat_seconds - boottime())):
                    await self._now.wait()

    def _renewed(self, valid_for: Mapping[str, float], sent: float) -> None:
        """A beat's answer: each lease holds `valid_for` seconds from when the server took the beat,
        so at least that long from `sent`, when the agent sent it. The first answer for an attempt
        sets its deadline, earlier too: its run order's `valid_for`, counted from when the order
        came, may have waited in the server's queue or on the connection."""
        for lease_id, seconds in valid_for.items():
            held = self._held.get(lease_id)
            first = lease_id in self._provisional
            self._provisional.discard(lease_id)
            if held is None or (held.run is not None and held.run.exited):
                continue  # ended, or its processes are gone: its deadline stays where the end found it
            if first:
                held.deadline = sent + float(seconds)
                self._held.guard.hold(lease_id, held.deadline)
            elif held.renewed(sent + float(seconds)):
                self._held.guard.hold(lease_id, held.deadline)
