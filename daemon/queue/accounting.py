"""Accounting records: one compact record per ended job, read back by day (issue 50).

The script that ends a job writes its record (lua/lib/account.lua, called by `finish`), in the
same call as the end itself, so each ended job has exactly one: a record written by a server
from the terminal events could be lost (the server down as the job ended) or doubled (two
servers reading the same events). Each queue keeps a list per day (keys.accounting), which
expires `accounting_retention_days` after its day, whatever the jobs' own retention: a year of
a busy pool is a year of short strings (about 40 bytes a job, as measured), and reading one day
is reading one list, in pages.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import cast

from daemon.queue import keys
from daemon.queue.connection import AnyRedis

DAY = 86400  # seconds; a record's day is its end's, in Redis time (UTC)
PAGE = 2000  # records read in one round trip: a busy day (10 000 jobs) is five

# A record's fields, in the order lib/account.lua writes them (bytes, split at spaces; the user
# is the rest of the record, up to byte 255): ms into its day it ended, its state's letter, its
# wait (ms from enqueue to first start; '-': never ran), GPU-ms, CPU-ms, mean GPU utilisation in
# percent ('-': not recorded), user, then the GPU-ms its utilisation was measured over (after byte
# 255; b'': all its GPU-ms, as every record of before the field reads). Left as bytes: a year of
# a busy pool is millions of records, and the reader converts only the fields it sums
# (daemon/server/accounting.py).
Record = list[bytes]
FAILED, DEAD, CANCELLED = b"f", b"d", b"c"  # the states' letters that are not success ('s')
UNKNOWN = b"-"
MEASURED = b"\xff"  # what comes before the measured GPU-ms: never in a user name (UTF-8)


def fields(raw: bytes) -> Record:
    """A record's eight fields, the last b'' where it has no measured GPU-ms of its own."""
    record = raw.split(b" ", 6)
    user, _, measured = record[6].partition(MEASURED)
    record[6:] = user, measured
    return record


def day_of(t: float) -> int:
    """The day (since the epoch) that Unix time `t` falls on."""
    return int(t // DAY)


async def read_day(redis: AnyRedis, queue: str, day: int) -> AsyncIterator[list[Record]]:
    """The records of `queue`'s jobs that ended on `day`, a page at a time, in the order they ended."""
    key = keys.accounting(queue, day)
    start = 0
    while True:
        # the pool's clients read bytes (connection.py: no decode_responses)
        page = cast(list[bytes], await redis.lrange(key, start, start + PAGE - 1))
        if page:
            yield [fields(raw) for raw in page]
        if len(page) < PAGE:
            return
        start += PAGE
