"""Job-end notifications: the server POSTs a job's final record to its `--notify` URL and to the
pool's `notify_url`, signed, retried with back-off, never in the way of anything else.

Theory of operation. What is owed lives in Redis, not here: the end of a job that has somewhere
to notify puts one entry per target in its queue's outbox, in the script that ends it
(queue/outbox.py). Servers take entries on from there and send them: at once for the ends the
events reader (queue/terminal_events.py) hands to `ended` (the fast path; their ids wait in a
bounded set, so the reader never waits), and by a sweep of every queue's outbox at start (the
catch-up after a downtime of any length), every `notify_timeout` seconds, and whenever a retry
or a lapsed hold comes due (the safety net: whatever a fault left in the outbox, a sweep finds).

Each entry taken is one `Delivery`, at most MAX_IN_FLIGHT of them, each one attempt: read the
job's record, POST, settle. An attempt ends within ATTEMPT_TIMES times notify_timeout, well inside
the hold its take gave it (HOLD_TIMES times notify_timeout), so no other server takes an entry this
one is on: one server sends each end, in the normal case. A 2xx, a refusal (a 3xx, a 4xx other
than 429) or the ATTEMPTS-th failure takes the entry out (sent, failed), as does a user's hook to
an address the pool does not notify (refused, before any connection: webhook_targets.py); a
connection error, a timeout, a 5xx or a 429 puts it back, due after 2, 4, 8, 16, then 32 s,
for whichever server comes first. A Redis error at any step leaves the entry in the outbox for a
later sweep; a server killed leaves what it held until the hold lapses, and another takes it: at
least once. A clean stop hands back what it holds, due at once. The bound is the job's record,
which the body is made of: an end is sent while the record is kept (job_retention after the
end); past that, or pushed out of a full outbox, it is dropped and counted.

Each POST carries the time it was signed, signed with the body. A user's own hook (`--notify`) is
signed with that user's key (webhook.user_key: made from their token, which they hold), never with
the pool's notify_secret, which only the pool's notify_url gets: a user never sees a POST the
pool's receiver would accept. An open pool (no tokens) has no key of a user's: their hooks go
unsigned.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
import orjson
from redis.exceptions import RedisError

from daemon import webhook
from daemon.aio import TaskSet, woken_or
from daemon.errors import JobNotFound
from daemon.metrics.server import ServerMetrics
from daemon.queue.job_queue import JobQueue
from daemon.queue.outbox import CHUNK, Outbox, Taken, Took, Verdict
from daemon.queue.terminal_events import Terminal
from daemon.server.notify_resolver import CheckedResolver, TargetRefused
from daemon.webhook_targets import Allowed

log = logging.getLogger(__name__)

ATTEMPTS = 6  # POSTs of one notification at most
FIRST_RETRY = 2.0  # seconds before the second; doubled before each next one: about a minute in all
POST_TIMEOUT = 10.0  # seconds one POST may take, connection included (config notify_timeout)
HOLD_TIMES = 6  # a take holds an entry this many POST timeouts: a killed server's, then lapses
ATTEMPT_TIMES = 3  # one attempt (record, POST, settle) ends within this many: inside the hold
MAX_IN_FLIGHT = 32  # deliveries taken on at once, each with its POST: beyond, left in the outbox
MAX_SEEN = 10_000  # ends seen and not yet taken on: beyond, left to the next sweep
RELEASE_TIMEOUT = 5.0  # seconds a stop spends handing back what it did not deliver


class Answer(enum.Enum):
    """How one POST went."""

    SENT = "sent"  # answered 2xx
    AGAIN = "again"  # may do better later: no connection, no answer, a 5xx or a 429
    FAILED = "failed"  # answered otherwise (a 3xx, another 4xx)
    REFUSED = "refused"  # a user's hook to an address the pool does not notify: not attempted


class Phase(enum.StrEnum):
    PREPARING = "preparing"  # reading the job's record
    SENDING = "sending"  # its POST under way
    SETTLING = "settling"  # telling the outbox how it went


@dataclass(slots=True)
class Delivery:
    """One attempt in flight: one job's end to one target, held in the outbox by this server."""

    taken: Taken
    phase: Phase = Phase.PREPARING


class Notifier:
    """Started and stopped with the server (service.py); `ended` is the events reader's callback."""

    def __init__(
        self,
        queue: JobQueue,
        metrics: ServerMetrics,
        *,
        pool_url: str,
        secret: str,
        allowed: Allowed | None = None,
        user_tokens: Mapping[str, bytes] | None = None,
        timeout: float = POST_TIMEOUT,
        first_retry: float = FIRST_RETRY,
    ) -> None:
        """`pool_url`: where every end goes too (config notify_url; empty: nowhere); `secret`: the
        signature's key of what goes to pool_url (empty: unsigned); `allowed`: the addresses
        users' hooks may reach besides public ones (config notify_allow); `user_tokens`: each
        user's token, of which their own hooks' key is made (None: an open pool, where they go
        unsigned); `timeout`: seconds a receiver has to answer a POST
        (config notify_timeout), which also sets how long a take holds an entry and how often
        the outboxes are swept."""
        self.queue = queue
        self.metrics = metrics
        self.pool_url = pool_url
        self.secret = secret.encode()
        self.allowed = allowed or Allowed()
        self.user_tokens = user_tokens
        self.timeout = timeout
        self.first_retry = first_retry
        self.outbox = Outbox(queue, HOLD_TIMES * timeout)
        self.sweep_every = timeout
        self._seen: dict[str, dict[str, None]] = {}  # queue -> ids of jobs that ended, in order
        self._seen_count = 0
        self._wake = asyncio.Event()  # an end seen, a delivery done, a retry due
        self._sweep_at = 0.0  # the loop's time of the next sweep: the first one at once
        self._deliveries: dict[tuple[str, str], Delivery] = {}
        self._tasks = TaskSet("notification task %s died")
        # Users' hooks go through the checked resolver; the pool's notify_url, the operator's,
        # wherever it points.
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._open = False  # taking ends: between start and stop
        self._failing = False  # said once per run of Redis errors, not once per try
        self._said_no_pool_url = False

    async def start(self) -> None:
        if self.pool_url and not self.secret:
            log.warning("notify_url is set without notify_secret: its notifications are not signed")
        for target, resolver in (
            (webhook.TARGET_JOB, CheckedResolver(self.allowed)),
            (webhook.TARGET_POOL, None),
        ):
            self._sessions[target] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(resolver=resolver),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                headers={"User-Agent": "gpupool"},
            )
        self._tasks.spawn(self._run(), "notifier")
        self._open = True

    def ended(self, event: Terminal) -> None:
        """A job ended: if it has notifications, they go out soon. Never waits."""
        if not self._open:
            return
        if self._seen_count >= MAX_SEEN:
            self._sweep_at = 0.0  # its entries, if any, wait in the outbox for the sweep
        else:
            ids = self._seen.setdefault(event.queue, {})
            if event.job_id not in ids:
                ids[event.job_id] = None
                self._seen_count += 1
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            room = MAX_IN_FLIGHT - len(self._deliveries)
            if room > 0 and loop.time() >= self._sweep_at:  # first: a stream of ends cannot starve it
                await self._sweep(room)
            elif room > 0 and self._seen:
                await self._take_seen(room)
            else:
                self._wake.clear()
                wait = self._sweep_at - loop.time() if room > 0 else self.sweep_every
                await woken_or(self._wake, max(0.0, wait))

    async def _take_seen(self, room: int) -> None:
        """Take on the entries of up to CHUNK ends seen of one queue (most have none)."""
        q, ids = next(iter(self._seen.items()))
        chunk = list(itertools.islice(ids, CHUNK))
        for job_id in chunk:
            del ids[job_id]
        if not ids:
            del self._seen[q]
        self._seen_count -= len(chunk)
        try:
            took = await self.outbox.take_ended(q, chunk, room)
        except RedisError as exc:
            self._redis_failed(f"cannot take on the ends of queue {q} to notify", exc)
            return
        self._failing = False
        self._deliver_all(q, took)

    async def _sweep(self, room: int) -> None:
        """Take on what is due in every queue's outbox, in one round trip: ends nobody has taken
        on (those of a downtime, those the fast path passed over), retries due, lapsed holds."""
        self._sweep_at = asyncio.get_running_loop().time() + self.sweep_every
        try:
            answers = await self.outbox.take_due(await self.queue.queues(), room)
        except RedisError as exc:
            self._redis_failed("cannot sweep the outboxes of job ends to notify", exc)
            return
        extra: list[Taken] = []
        for q, took in answers:
            if isinstance(took, Exception):
                self._redis_failed(f"cannot sweep queue {q}'s outbox of job ends to notify", took)
                continue
            extra += self._deliver_all(q, took)
        if not any(isinstance(took, Exception) for _, took in answers):
            self._failing = False
        if extra:  # several queues had more due than there was room for: theirs again at once
            try:
                await self.outbox.hand_back(extra)
            except RedisError as exc:
                self._redis_failed(f"cannot hand back {len(extra)} job end(s) to notify", exc)

    def _redis_failed(self, what: str, exc: Exception) -> None:
        if not self._failing:
            log.warning("%s (%s): they stay in the outbox, for a later sweep", what, exc)
        self._failing = True

    def _deliver_all(self, queue: str, took: Took) -> list[Taken]:
        """Start a delivery for each entry taken while there is room; the others, returned."""
        for dropped, why in (
            (took.pushed_out, "were pushed out of its full outbox (is a receiver down?)"),
            (took.expired, "waited past job_retention, and their records are gone"),
        ):
            if dropped:
                self.metrics.notification("dropped", dropped)
                log.warning("%d job end(s) of queue %s %s: not notified", dropped, queue, why)
        if took.next_due is not None:
            self._due_in(took.next_due)
        room = max(0, MAX_IN_FLIGHT - len(self._deliveries))
        for taken in took.taken[:room]:
            delivery = Delivery(taken)
            self._deliveries[taken.job_id, taken.target] = delivery
            self._tasks.spawn(self._deliver(delivery), f"notify {taken.member}")
        return took.taken[room:]

    def _due_in(self, seconds: float) -> None:
        """Something in an outbox comes due then: sweep no later."""
        self._sweep_at = min(self._sweep_at, asyncio.get_running_loop().time() + seconds)
        self._wake.set()

    async def _deliver(self, d: Delivery) -> None:
        taken = d.taken
        try:
            async with asyncio.timeout(ATTEMPT_TIMES * self.timeout):
                await self._attempt(d)
        except (RedisError, TimeoutError) as exc:
            log.warning(
                "notifying job %s's end (%s) stopped while %s (%r): it stays in the outbox, and is "
                "sent again once this server's hold on it lapses",
                taken.job_id,
                taken.target,
                d.phase,
                exc,
            )
        finally:
            del self._deliveries[taken.job_id, taken.target]
            self._wake.set()  # room for one more

    async def _attempt(self, d: Delivery) -> None:
        """One attempt at one delivery, settled in the outbox."""
        taken = d.taken
        try:
            job = await self.queue.get(taken.job_id)
        except JobNotFound:  # expired since it was taken
            self.metrics.notification("dropped")
            log.warning("job %s's record expired before its end was notified: not sent", taken.job_id)
            await self.outbox.settle(taken, Verdict.DONE)
            return
        url = job.spec.notify if taken.target == webhook.TARGET_JOB else self.pool_url
        if not url:
            self.metrics.notification("dropped")
            if not self._said_no_pool_url:  # once: a server without it may owe thousands
                log.warning(
                    "job %s's end, and maybe others, is owed to the pool's notify_url, and this server "
                    "has none: not sent (give every server of the pool the same notify_url)",
                    taken.job_id,
                )
            self._said_no_pool_url = True
            await self.outbox.settle(taken, Verdict.DONE)
            return
        body = orjson.dumps(webhook.end_record(job.to_dict()))
        d.phase = Phase.SENDING
        answer, why = await self._post(taken, url, self._key(taken.target, job.spec.user), body)
        d.phase = Phase.SETTLING
        attempt = taken.tries + 1
        if answer is Answer.SENT:
            self.metrics.notification("sent")
            await self._settle(taken, Verdict.DONE)
        elif answer is Answer.REFUSED:
            # Counted apart from failed, and never tried: whether such a target answers is
            # what a user must not learn.
            log.warning(
                "not notifying %s of job %s's end: %s, which notify_allow does not allow",
                webhook.shown(url),
                taken.job_id,
                why,
            )
            self.metrics.notification("refused")
            await self._settle(taken, Verdict.DONE)
        elif answer is Answer.AGAIN and attempt < ATTEMPTS:
            pause = self.first_retry * 2 ** (attempt - 1)
            shown = webhook.shown(url)
            log.info("notifying %s of job %s's end: %s; again in %g s", shown, taken.job_id, why, pause)
            if await self._settle(taken, Verdict.RETRY, pause):
                self._due_in(pause)
        else:
            log.warning(
                "notifying %s of job %s's end failed after %d attempt(s): %s",
                webhook.shown(url),
                taken.job_id,
                attempt,
                why,
            )
            self.metrics.notification("failed")
            await self._settle(taken, Verdict.DONE)

    async def _settle(self, taken: Taken, verdict: Verdict, pause: float = 0.0) -> bool:
        settled = await self.outbox.settle(taken, verdict, pause)
        if not settled:
            log.info(
                "job %s's end (%s) was taken over by another server while this one was on it",
                taken.job_id,
                taken.target,
            )
        return settled

    def _key(self, target: str, user: str) -> bytes:
        """The key a delivery to `target` of `user`'s job is signed with; empty: unsigned."""
        if target == webhook.TARGET_POOL:
            return self.secret
        token = (self.user_tokens or {}).get(user)
        return webhook.user_key(token) if token else b""

    async def _post(self, taken: Taken, url: str, key: bytes, body: bytes) -> tuple[Answer, str]:
        """One POST, signed with `key` (empty: unsigned): how it went, and why when not sent."""
        if taken.target == webhook.TARGET_JOB and (why := self.allowed.url_refusal(url)):
            return Answer.REFUSED, why  # an address in the URL: the client would not look it up
        now = int(time.time())
        headers = {
            "Content-Type": "application/json",
            webhook.EVENT_HEADER: webhook.EVENT,
            webhook.DELIVERY_HEADER: taken.member,
            webhook.TIMESTAMP_HEADER: str(now),
        }
        if key:
            headers[webhook.SIGNATURE_HEADER] = webhook.sign(key, now, body)
        session = self._sessions[taken.target]
        try:  # never a redirect: its Location would be a target no one judged
            async with session.post(url, data=body, headers=headers, allow_redirects=False) as r:
                status = r.status
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, TargetRefused):
                return Answer.REFUSED, str(exc.os_error)
            return Answer.AGAIN, f"cannot connect ({exc.os_error.strerror or exc.os_error})"
        except TimeoutError:
            return Answer.AGAIN, f"no answer within {self.timeout:g} s"
        except aiohttp.ClientError as exc:
            return Answer.AGAIN, f"{type(exc).__name__}"
        if 200 <= status < 300:
            return Answer.SENT, ""
        if 300 <= status < 400:
            return Answer.FAILED, f"HTTP {status}: a redirect, which is not followed"
        return (Answer.AGAIN if status >= 500 or status == 429 else Answer.FAILED), f"HTTP {status}"

    async def stop(self) -> None:
        """Stop sending; hand back what was taken on and not delivered. Safe to call twice."""
        self._open = False
        held = [d.taken for d in self._deliveries.values()]
        await self._tasks.stop()
        if held:
            try:
                async with asyncio.timeout(RELEASE_TIMEOUT):
                    back = await self.outbox.hand_back(held)
                log.info("%d notification(s) not delivered yet: handed back, for the next server", back)
            except (RedisError, TimeoutError) as exc:
                log.warning(
                    "%d notification(s) not delivered could not be handed back (%r): sent once their "
                    "hold lapses",
                    len(held),
                    exc,
                )
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()
