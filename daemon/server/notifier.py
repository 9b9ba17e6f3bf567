"""Job-end notifications: the server POSTs a job's final record to its `--notify` URL and to the
pool's `notify_url`, signed, retried with back-off, never in the way of anything else.

Theory of operation. The events reader (queue/terminal_events.py) hands each terminal event to
`ended`, which only puts the job id in a bounded queue: the reader, and with it every `wait` and the
rest of the server, never waits on a receiver. One task takes the ids in turn, reads the job's
record, and for each URL it must go to claims the delivery in Redis (queue/notified.py), so that of
a pool's servers one sends it, once; then a task of its own POSTs it (at most MAX_SENDING at once),
again after 2, 4, 8, 16 and 32 s on a connection error, a timeout, a 5xx or a 429, and gives up
after ATTEMPTS. Each delivery in flight is one `Delivery` in one map, at most MAX_PENDING of them:
beyond, an end is dropped, logged and counted. A clean stop hands back the claims of deliveries not
done, and a start sends the ends of the last CATCH_UP seconds nobody claimed: those handed back and
those of the server's downtime. A server killed in the middle of a delivery loses it; a receiver may
see an end twice (a stop between its answer and the claim's release): it dedupes by the job id.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass

import aiohttp
import orjson
from redis.exceptions import RedisError

from daemon import webhook
from daemon.aio import TaskSet
from daemon.errors import JobNotFound
from daemon.metrics.server import ServerMetrics
from daemon.queue import notified
from daemon.queue.job_queue import JobQueue
from daemon.queue.terminal_events import Terminal

log = logging.getLogger(__name__)

ATTEMPTS = 6  # POSTs of one notification at most
FIRST_RETRY = 2.0  # seconds before the second; doubled before each next one: about a minute in all
POST_TIMEOUT = 10.0  # seconds one POST may take, connection included (config notify_timeout)
MAX_SENDING = 32  # POSTs at once
MAX_PENDING = 10_000  # ends not yet read, and deliveries in flight (each): beyond, dropped and counted
CATCH_UP = 900.0  # seconds of past ends a start sends if nobody claimed them
RELEASE_TIMEOUT = 5.0  # seconds a stop spends handing back what it did not deliver
TARGETS = ("job", "pool")  # the job's own --notify URL; the pool's notify_url


class Phase(enum.StrEnum):
    SENDING = "sending"  # waiting for a sending slot, or its POST under way
    BACKING_OFF = "backing_off"  # between two attempts


@dataclass(slots=True)
class Delivery:
    """One notification in flight: one job's end to one URL."""

    job_id: str
    target: str  # one of TARGETS
    url: str
    body: bytes
    attempt: int = 0
    phase: Phase = Phase.SENDING


class Notifier:
    """Started and stopped with the server (service.py); `ended` is the events reader's callback."""

    def __init__(
        self,
        queue: JobQueue,
        metrics: ServerMetrics,
        *,
        pool_url: str,
        secret: str,
        retention: float,
        first_retry: float = FIRST_RETRY,
        timeout: float = POST_TIMEOUT,
    ) -> None:
        """`pool_url`: where every end goes too (config notify_url; empty: nowhere); `secret`: the
        signature's key (empty: unsigned); `retention`: how long a claim lasts (job_retention);
        `timeout`: seconds a receiver has to answer a POST (config notify_timeout)."""
        self.queue = queue
        self.metrics = metrics
        self.pool_url = pool_url
        self.secret = secret.encode()
        self.retention = retention
        self.first_retry = first_retry
        self.timeout = timeout
        self._ends: asyncio.Queue[str] = asyncio.Queue(MAX_PENDING)
        self._deliveries: dict[tuple[str, str], Delivery] = {}
        self._sending = asyncio.Semaphore(MAX_SENDING)
        self._tasks = TaskSet("notification task %s died")
        self._session: aiohttp.ClientSession | None = None
        self._open = False  # taking ends: between start and stop
        self._dropping = False  # said once per run of drops, not once per end

    async def start(self) -> None:
        if self.pool_url and not self.secret:
            log.warning("notify_url is set without notify_secret: its notifications are not signed")
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout), headers={"User-Agent": "gpupool"}
        )
        self._tasks.spawn(self._run(), "notifier")
        self._open = True

    def ended(self, event: Terminal) -> None:
        """A job ended: its notifications go out soon, in order. Never waits."""
        if not self._open:
            return
        if event.ended_at is not None and event.ended_at < time.time() - CATCH_UP:
            return  # history: a queue new to this server is read from its first event
        self._offer(event.job_id)

    def _offer(self, job_id: str) -> None:
        try:
            self._ends.put_nowait(job_id)
        except asyncio.QueueFull:
            self._dropped(f"job {job_id} ended with {MAX_PENDING} ends waiting to be notified")
        else:
            self._dropping = False

    def _dropped(self, why: str) -> None:
        self.metrics.notification("dropped")
        if not self._dropping:
            log.warning("%s: its notification, and those of the ends after it, are dropped", why)
        self._dropping = True

    async def _run(self) -> None:
        await self._catch_up()
        while True:
            job_id = await self._ends.get()
            try:
                await self._dispatch(job_id)
            except RedisError as exc:
                log.warning("cannot read job %s to notify its end (%s): not sent", job_id, exc)

    async def _catch_up(self) -> None:
        """Send the recent ends nobody claimed: those of the server's downtime, those handed back."""
        since = time.time() - CATCH_UP
        try:
            for q in await self.queue.queues():
                for job_id in await notified.recent_ends(self.queue.redis, q, since, MAX_PENDING):
                    await self._dispatch(job_id)
        except RedisError as exc:
            log.warning("cannot read the recent job ends to notify (%s): those are not sent", exc)

    async def _dispatch(self, job_id: str) -> None:
        """Start a delivery of the job's end to each URL it goes to that nobody has claimed."""
        try:
            job = await self.queue.get(job_id)
        except JobNotFound:  # expired since: nothing to say
            return
        urls = dict(zip(TARGETS, (job.spec.notify, self.pool_url), strict=True))
        body = b""
        for target, url in urls.items():
            if not url or (job_id, target) in self._deliveries:
                continue
            if len(self._deliveries) >= MAX_PENDING:
                self._dropped(f"{MAX_PENDING} notifications are in flight")
                continue
            if not await notified.claim(self.queue.redis, job_id, target, self.retention):
                continue  # another server's, or sent already
            body = body or orjson.dumps(webhook.end_record(job.to_dict()))
            delivery = Delivery(job_id, target, url, body)
            self._deliveries[job_id, target] = delivery
            self._tasks.spawn(self._deliver(delivery), f"notify {job_id} ({target})")

    async def _deliver(self, d: Delivery) -> None:
        why = ""
        for attempt in range(1, ATTEMPTS + 1):
            d.attempt, d.phase = attempt, Phase.SENDING
            async with self._sending:
                why, again = await self._post(d)
            if not why:
                self.metrics.notification("sent")
                del self._deliveries[d.job_id, d.target]
                return
            if not again or attempt == ATTEMPTS:
                break
            pause = self.first_retry * 2 ** (attempt - 1)
            log.info(
                "notifying %s of job %s's end: %s; again in %g s", webhook.shown(d.url), d.job_id, why, pause
            )
            d.phase = Phase.BACKING_OFF
            await asyncio.sleep(pause)
        log.warning(
            "notifying %s of job %s's end failed after %d attempt(s): %s",
            webhook.shown(d.url),
            d.job_id,
            d.attempt,
            why,
        )
        self.metrics.notification("failed")
        del self._deliveries[d.job_id, d.target]

    async def _post(self, d: Delivery) -> tuple[str, bool]:
        """One POST: ("", _) if answered 2xx; else why not, and whether another attempt may do better."""
        assert self._session is not None
        headers = {
            "Content-Type": "application/json",
            webhook.EVENT_HEADER: webhook.EVENT,
            webhook.DELIVERY_HEADER: f"{d.job_id}/{d.target}",
        }
        if self.secret:
            headers[webhook.SIGNATURE_HEADER] = webhook.sign(self.secret, d.body)
        try:
            async with self._session.post(d.url, data=d.body, headers=headers, allow_redirects=False) as r:
                status = r.status
        except aiohttp.ClientConnectorError as exc:
            return f"cannot connect ({exc.os_error.strerror or exc.os_error})", True
        except TimeoutError:
            return f"no answer within {self.timeout:g} s", True
        except aiohttp.ClientError as exc:
            return f"{type(exc).__name__}", True
        if 200 <= status < 300:
            return "", False
        if 300 <= status < 400:
            return f"HTTP {status}: a redirect, which is not followed", False
        return f"HTTP {status}", status >= 500 or status == 429

    async def stop(self) -> None:
        """Stop sending; hand back the claims of what was not delivered. Safe to call twice."""
        self._open = False
        await self._tasks.stop()
        unfinished = list(self._deliveries)
        self._deliveries.clear()
        if unfinished:
            try:
                async with asyncio.timeout(RELEASE_TIMEOUT):
                    await notified.release(self.queue.redis, unfinished)
                log.info("%d notification(s) not delivered yet: the next start sends them", len(unfinished))
            except (RedisError, TimeoutError) as exc:
                log.warning("%d notification(s) not delivered are lost (%r)", len(unfinished), exc)
        if self._session is not None:
            await self._session.close()
            self._session = None
