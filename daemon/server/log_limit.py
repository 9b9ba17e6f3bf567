"""Warnings a user's requests cause, rate-limited per user: one user's flood cannot flood the log.

A request that fails in a way the operator should hear of (the store or Redis failing, Redis full,
a request that broke) is logged as a warning; a user who pipelines such requests could otherwise
write thousands of lines a second, burying everyone else's and filling the disk. Each user (or
peer, before one is known) has a token bucket: BURST warnings at once, refilled at BURST per
INTERVAL. Past it their warnings are counted, not written, and one line says how many were
suppressed: at most once per INTERVAL while they go on, and before their next warning written.
The newest REMEMBERED users are kept; one forgotten starts with a full bucket.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

BURST = 5  # warnings written at once
INTERVAL = 60.0  # seconds in which BURST more are allowed; and between two "suppressed" lines
REMEMBERED = 1024


@dataclass(slots=True)
class Bucket:
    """One user's allowance: warnings that may be written now, when that was reckoned, and how
    many were suppressed since their last line about it."""

    tokens: float
    reckoned: float
    suppressed: int = 0
    summarised: float = 0.0  # when the last "suppressed" line was written


class LogLimit:
    def __init__(
        self,
        *,
        burst: int = BURST,
        interval: float = INTERVAL,
        remembered: int = REMEMBERED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst, self.interval = burst, interval
        self._remembered = remembered
        self._clock = clock
        self._buckets: OrderedDict[str, Bucket] = OrderedDict()

    def warning(
        self,
        logger: logging.Logger,
        who: str,
        message: str,
        *args: object,
        level: int = logging.WARNING,
        exc_info: bool = False,
    ) -> None:
        """`logger.log(level, message, *args)` unless `who` is past their allowance (then counted)."""
        now = self._clock()
        bucket = self._bucket(who, now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.reckoned) * self.burst / self.interval)
        bucket.reckoned = now
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            self._summarise(logger, who, bucket, now)
            logger.log(level, message, *args, exc_info=exc_info)
            return
        bucket.suppressed += 1
        if now - bucket.summarised >= self.interval:
            self._summarise(logger, who, bucket, now)

    def _summarise(self, logger: logging.Logger, who: str, bucket: Bucket, now: float) -> None:
        if bucket.suppressed:
            logger.warning("%d more warnings like these from %s suppressed", bucket.suppressed, who)
            bucket.suppressed = 0
            bucket.summarised = now

    def _bucket(self, who: str, now: float) -> Bucket:
        bucket = self._buckets.pop(who, None) or Bucket(float(self.burst), now, summarised=now)
        self._buckets[who] = bucket  # the newest at the end: the least recently heard go first
        while len(self._buckets) > self._remembered:
            self._buckets.popitem(last=False)
        return bucket
