"""Heartbeats: ONE Redis round trip per interval says a worker is alive and keeps all its leases.

Every `interval` seconds the worker sends one pipelined batch (scripts.ScriptBatch): heartbeat.lua
(its registration and last-seen time, by Redis's clock) and one renew.lua call per queue in which
it runs jobs, each renewal fenced by the lease. The cost does not grow with the number of running
jobs beyond one script call per queue. The answers, keyed by lease id, decide each attempt's fate:

- OK: the lease is extended by the lease length, from Redis's clock; the worker moves the
  attempt's self-fence deadline to the time this beat was *sent* plus the lease, less `margin`
  (attempt.py says why the send time);
- LOST: the lease was reclaimed (this worker was presumed dead) or the job ended: the target kills
  the attempt's process group at once and records nothing, since the attempt is not its own any more;
- CANCEL: the user cancelled: the target stops the job and records it as cancelled.

A beat that fails moves no deadline, so an attempt whose renewals keep failing (Redis unreachable,
a network split, Redis at its memory limit) dies at its own deadline, before the reaper can hand
it to another worker: one live execution at a time holds through all of these. `healthy` is set
while beats succeed: a worker claims nothing while it is clear, since it could not renew what it
claimed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from redis.exceptions import RedisError

from daemon.errors import NotReplicated
from daemon.job import Lease, RenewStatus
from daemon.queue.job_queue import JobQueue
from daemon.queue.registry import Registration, add_heartbeat
from daemon.worker.attempt import boottime

log = logging.getLogger(__name__)


class Refused(RedisError):
    """Redis refused the registration (at its memory limit, say); the renewals' answers, by
    lease id, when they went through all the same."""

    def __init__(self, error: BaseException, statuses: dict[str, RenewStatus] | None) -> None:
        super().__init__(str(error))
        self.error = error
        self.statuses = statuses


class HeartbeatTarget(Protocol):
    """What a heartbeat needs from its worker."""

    def registration(self) -> Registration: ...

    def leases(self) -> Sequence[Lease]: ...

    def renewed(self, statuses: Mapping[str, RenewStatus], until: float) -> None:
        """The answers of one beat by lease id; the OK ones hold until `until` (boottime)."""


class Heartbeat:
    """`beat()` is one heartbeat; `run()` beats every `interval` seconds until cancelled."""

    def __init__(self, queue: JobQueue, target: HeartbeatTarget, interval: float) -> None:
        self.queue = queue
        self.target = target
        self.interval = interval
        self.lease = queue.lease_ms / 1000
        self.margin = min(interval, self.lease / 3)
        self.timeout = max(interval, 1.0)  # a beat that takes longer (a half-open connection) failed
        self.round_trip = 0.0  # seconds the last successful heartbeat took
        self.healthy = asyncio.Event()  # set while beats succeed
        self._failing_since: float | None = None
        self._poked = asyncio.Event()
        # Told each beat's round trip (seconds), or None for a failed beat: the worker's metrics.
        self.observer: Callable[[float | None], None] | None = None

    def poke(self) -> None:
        """Beat now rather than at the next interval (news is waiting, e.g. a cancel)."""
        self._poked.set()

    async def listen_for_pokes(self, channel: str, other: Callable[[str], bool] | None = None) -> None:
        """Subscribe to `channel` and beat at once on every message, until cancelled; but for a
        message that `other` takes (it returns True: news of a channel, worker/execs.py). Best
        effort: while the subscription is down (Redis restarting), the regular beats carry the
        news (a channel opened meanwhile is told again by its server: server/channels.py)."""
        while True:
            pubsub = self.queue.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                async for message in pubsub.listen():
                    data = message.get("data")
                    text = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
                    if other is None or not other(text):
                        self.poke()
            except (RedisError, OSError) as exc:
                log.debug("pokes on %s interrupted (%s); resubscribing", channel, exc)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis-py 8.2
            await asyncio.sleep(self.interval)

    async def beat(self) -> dict[str, RenewStatus]:
        """Refresh the registration and renew every lease in one round trip; the renewals'
        answers by lease id. Raises RedisError (or TimeoutError) when Redis does not answer, or
        refuses the registration (`Refused`, carrying the renewals' answers when those went
        through, as at Redis's memory limit)."""
        registration = self.target.registration()
        batch = self.queue.batch()
        registered = add_heartbeat(batch, self.queue.scripts, registration)
        answers = self.queue.add_renewals(batch, registration.id, self.target.leases())
        replies = await batch.execute_each()
        renewals = [r for i, r in enumerate(replies) if i != registered]
        statuses = None if any(isinstance(r, Exception) for r in renewals) else answers(replies)
        if isinstance(replies[registered], Exception):
            raise Refused(replies[registered], statuses)
        if statuses is None:
            raise next(r for r in renewals if isinstance(r, Exception))
        return statuses

    async def beat_and_apply(self) -> bool:
        """One heartbeat, its answers handed to the target, failures logged (once per outage).
        True when Redis answered it all: only then may the worker claim."""
        loop = asyncio.get_running_loop()
        started, sent = loop.time(), boottime()
        try:
            # A beat that hangs (a half-open connection) counts as failed, and the next one retries.
            async with asyncio.timeout(self.timeout):
                statuses = await self.beat()
        except Refused as exc:
            if exc.statuses is not None:  # the leases were renewed all the same
                self.target.renewed(exc.statuses, sent + self.lease - self.margin)
            self._failed(started, exc.error)
            return False
        except (RedisError, NotReplicated, TimeoutError, OSError) as exc:
            self._failed(started, exc)
            return False
        except Exception as exc:  # a bug here must not end the heartbeat for good: logged, retried
            log.exception("heartbeat failed unexpectedly")
            self._failed(started, exc)
            return False
        self.round_trip = loop.time() - started
        if self.observer is not None:
            self.observer(self.round_trip)
        if self._failing_since is not None:
            log.info("heartbeat: Redis answers again after %.1f s", started - self._failing_since)
            self._failing_since = None
        self.target.renewed(statuses, sent + self.lease - self.margin)
        self.healthy.set()
        return True

    def _failed(self, started: float, exc: BaseException) -> None:
        self.healthy.clear()
        if self.observer is not None:
            self.observer(None)
        if self._failing_since is None:
            self._failing_since = started
            log.warning(
                "heartbeat failed (%s); no new jobs until it works, and running ones are killed if "
                "their leases go %.1f s without a renewal",
                str(exc) or type(exc).__name__,
                self.lease - self.margin,
            )

    async def run(self) -> None:
        """Beat every `interval` seconds (measured from each beat's start) until cancelled; at once
        when poked."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                started = loop.time()
                self._poked.clear()
                await self.beat_and_apply()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, started + self.interval - loop.time())):
                        await self._poked.wait()
        finally:
            self.healthy.clear()  # no beats any more: nothing may be claimed
