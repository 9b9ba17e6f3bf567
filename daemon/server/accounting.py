"""`poolctl acct`: what the jobs that ended in a span used, summed per user, queue or day (issue 50).

The server reads the queues' accounting records (queue/accounting.py) day by day, a page at a
time, and adds each into its group's `Totals`, so a request holds one page and one `Totals` per
group whatever the number of jobs, and its work is bounded by its span: at most MAX_DAYS days.
Wait times go into a `Quantiles` sketch (buckets a factor of 1.01 apart), so p50 and p90 are
within 1 % of the exact value at a fixed size, however many jobs a year holds.

Who sees what: an admin, every user's jobs (or the one user asked for); anyone else, their own,
and asking for another user's is refused (PERMISSION_DENIED).

What a request costs: every record of its span and queues is read and split, whoever asks (a
user's own are not kept apart), 1 to 2 microseconds each (measured: 200 000 records, 0.14 s of
CPU for a user with none of them, 0.4 s for an admin's table of all): a year of a pool ending
10 000 jobs a day, some 3.7 million records, is 3 to 7 s of the server's CPU. So `Accountant`
answers one request of each user at a time (ACCT_AT_ONCE), and a request yields between its pages
(PAGE records), so the server serves everyone else meanwhile.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from daemon.errors import GpupoolError
from daemon.queue.accounting import CANCELLED, DAY, DEAD, FAILED, UNKNOWN, day_of, read_day
from daemon.queue.connection import AnyRedis
from daemon.spec_checks import QUEUE_NAME
from protocol import Account, Accounted, ErrorCode

BY = ("user", "queue", "day")
DEFAULT_SPAN = 30 * DAY  # seconds back `since` defaults to
MAX_DAYS = 366  # days one request may span: a year, whatever the records kept
ACCT_AT_ONCE = 1  # acct requests of one user answered at once: each may read a year of records
GAMMA = 1.01  # the ratio between neighbouring buckets of a Quantiles: its relative error is half of 1 %


class Quantiles:
    """A fixed-precision sketch of values >= 0 (DDSketch's buckets): each value counts in the bucket
    of its logarithm to base GAMMA, and a quantile answers its bucket's middle, within 0.5 % of
    the exact value; zero (and anything under a millisecond) has a bucket of its own."""

    def __init__(self) -> None:
        self.zero = 0
        self.buckets: Counter[int] = Counter()
        self.count = 0

    def add(self, value: float) -> None:
        self.count += 1
        if value < 0.001:
            self.zero += 1
        else:
            self.buckets[math.ceil(math.log(value, GAMMA))] += 1

    def quantile(self, q: float) -> float | None:
        """The value at rank ceil(q * count) (nearest rank, from 1); None when there is none."""
        if not self.count:
            return None
        rank = max(1, math.ceil(q * self.count))
        if rank <= self.zero:
            return 0.0
        seen = self.zero
        for index in sorted(self.buckets):
            seen += self.buckets[index]
            if seen >= rank:
                return 2 * GAMMA**index / (GAMMA + 1)
        raise AssertionError("a rank within the count falls in a bucket")


@dataclass(slots=True)
class Totals:
    """One group's sums, in ms as the records keep them. `measured_gpu_ms` are the GPU-ms of its
    jobs' attempts whose usage the worker recorded, `used_gpu_ms` those weighted by their
    utilisation (percent): efficiency is the second over the first, and says nothing where
    nothing was measured."""

    jobs: int = 0
    failed: int = 0
    cancelled: int = 0
    gpu_ms: int = 0
    cpu_ms: int = 0
    measured_gpu_ms: int = 0
    used_gpu_ms: int = 0
    waits: Quantiles = field(default_factory=Quantiles)

    def add(
        self, state: bytes, wait: bytes, gpu: bytes, cpu: bytes, util: bytes, *, measured: bytes = b""
    ) -> None:
        """Count one record's fields (queue/accounting.py's layout), converting only those it sums:
        a year of a busy pool is millions of them. Its utilisation weighs the GPU-ms it was
        measured over (`measured`; b'': all its GPU-ms), never those of an attempt not measured."""
        self.jobs += 1
        if state in (FAILED, DEAD):
            self.failed += 1
        elif state == CANCELLED:
            self.cancelled += 1
        gpu_ms = int(gpu)
        self.gpu_ms += gpu_ms
        self.cpu_ms += int(cpu)
        if util != UNKNOWN and gpu_ms:
            weight = int(measured) if measured else gpu_ms
            self.measured_gpu_ms += weight
            self.used_gpu_ms += weight * int(util)
        if wait != UNKNOWN:
            self.waits.add(int(wait) / 1000)

    def merge(self, other: Totals) -> None:
        self.jobs += other.jobs
        self.failed += other.failed
        self.cancelled += other.cancelled
        self.gpu_ms += other.gpu_ms
        self.cpu_ms += other.cpu_ms
        self.measured_gpu_ms += other.measured_gpu_ms
        self.used_gpu_ms += other.used_gpu_ms
        self.waits.zero += other.waits.zero
        self.waits.count += other.waits.count
        self.waits.buckets.update(other.waits.buckets)

    def row(self) -> dict[str, Any]:
        """The sums as a reply's row (docs/PROTOCOL.md: Accounted)."""
        return {
            "jobs": self.jobs,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "gpu_hours": self.gpu_ms / 3_600_000,
            "cpu_hours": self.cpu_ms / 3_600_000,
            "efficiency": self.used_gpu_ms / 100 / self.measured_gpu_ms if self.measured_gpu_ms else None,
            "wait_p50": self.waits.quantile(0.5),
            "wait_p90": self.waits.quantile(0.9),
        }


def _refused(sentence: str) -> GpupoolError:
    return GpupoolError(sentence, ErrorCode.INVALID_ARGUMENT)


def span(request: Account, now: float) -> tuple[float, float]:
    """The request's (since, until), its defaults filled in; refused when out of order or longer
    than MAX_DAYS."""
    until = now if request.until is None else request.until
    since = until - DEFAULT_SPAN if request.since is None else request.since
    if not (math.isfinite(since) and math.isfinite(until)):
        raise _refused("acct: --since and --until must be times (Unix seconds), not infinite or NaN")
    if since > until:
        raise _refused("acct: --since comes after --until: give the earlier time as --since")
    if until - since > MAX_DAYS * DAY:
        raise _refused(
            f"acct: the span asked for is {(until - since) / DAY:.0f} days; one request covers at most "
            f"{MAX_DAYS}: ask for each year apart"
        )
    return since, until


def whose(request: Account, user: str, admins: frozenset[str]) -> str | None:
    """Whose jobs `user` sees (None: everyone's); refused when they ask for someone else's and are
    not an admin."""
    if user in admins:
        return request.user
    if request.user not in (None, user):
        raise GpupoolError(
            f"acct: you are {user}: only a pool admin may see another user's accounting "
            f"({request.user}); leave out --user to see your own",
            ErrorCode.PERMISSION_DENIED,
        )
    return user


async def account(
    redis: AnyRedis, queues: Iterable[str], request: Account, user: str, admins: frozenset[str]
) -> Accounted:
    """Answer `request`, made by `user`, from the accounting records of `queues` (the pool's)."""
    if request.by not in BY:
        raise _refused(f"acct: cannot group by {request.by!r}: give --by user, queue or day")
    if request.queue is not None and not QUEUE_NAME.fullmatch(request.queue):
        raise _refused(f"acct: {request.queue!r} is no queue name (letters, digits, _ and -, 1 to 64)")
    who = whose(request, user, admins)
    since, until = span(request, time.time())
    groups: dict[str, Totals] = {}
    chosen = [request.queue] if request.queue is not None else sorted(queues)
    mine = None if who is None else who.encode()
    for day in range(day_of(since), day_of(until) + 1):
        # ms into the day that the span starts and ends at: cut only on its first and last day
        start, end = (since - day * DAY) * 1000, (until - day * DAY) * 1000
        whole = start <= 0 and end >= DAY * 1000
        for queue in chosen:
            # the group of every record here, but by user: the record's own
            group = queue if request.by == "queue" else time.strftime("%Y-%m-%d", time.gmtime(day * DAY))
            async for page in read_day(redis, queue, day):
                for into_day, state, wait, gpu, cpu, util, owner, measured in page:
                    if (mine is not None and owner != mine) or not (whole or start <= int(into_day) <= end):
                        continue
                    key = owner.decode(errors="replace") if request.by == "user" else group
                    totals = groups.get(key)
                    if totals is None:
                        totals = groups[key] = Totals()
                    totals.add(state, wait, gpu, cpu, util, measured=measured)
    total = Totals()
    rows = []
    for key in sorted(groups):
        total.merge(groups[key])
        rows.append({request.by: key, **groups[key].row()})
    return Accounted(rows, total.row(), since, until)


class Accountant:
    """The server's `poolctl acct`: answers `account`, at most ACCT_AT_ONCE requests of each user at
    once (a request past them is refused at once, UNAVAILABLE: nothing queues up behind it)."""

    def __init__(self) -> None:
        self._running: Counter[str] = Counter()  # user -> their requests being answered now

    async def answer(
        self, redis: AnyRedis, queues: Iterable[str], request: Account, user: str, admins: frozenset[str]
    ) -> Accounted:
        if self._running[user] >= ACCT_AT_ONCE:
            raise GpupoolError(
                f"acct: {user} already has an acct request running, the most one user may at once "
                "(each reads every record of its span); wait for its answer, then ask again",
                ErrorCode.UNAVAILABLE,
            )
        self._running[user] += 1
        try:
            return await account(redis, queues, request, user, admins)
        finally:
            self._running[user] -= 1
            if not self._running[user]:
                del self._running[user]
