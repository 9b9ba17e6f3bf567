"""The warnings users' requests cause are rate-limited per user (issue 44 item 9): a real pool
server, a real Redis made full, pipelined requests from a real client, and the server's log."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from daemon.client.session import ClientError
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.server.log_limit import BURST, LogLimit
from daemon.server.session import warned_as
from protocol import Enqueue, Enqueued
from tests.support.faults import memory_full
from tests.support.pool import Pool, running_pool

pytestmark = pytest.mark.timeout(60)

FLOOD = 300
SAID_OF_REFUSALS = ("request Enqueue", "could not name queues", "suppressed")


async def refused_enqueues(pool: Pool, user: str, count: int) -> None:
    """`count` enqueues by `user`, pipelined on one connection, each refused (Redis is full)."""
    async with pool.client(user) as client:
        results = await asyncio.gather(
            *(client.call(Enqueue({"argv": ["true"]}, None), Enqueued) for _ in range(count)),
            return_exceptions=True,
        )
    assert all(isinstance(r, ClientError) and "maxmemory" in str(r) for r in results), results[:3]


def warnings_written(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings the refusals caused, and the lines about those suppressed, in order."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and any(w in r.getMessage() for w in SAID_OF_REFUSALS)
    ]


async def test_one_users_flood_of_failing_requests_writes_a_few_lines(
    redis_server: EmbeddedRedis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """issue 44 item 9: one user pipelining bad requests wrote 29 000 warning lines in 12 s. Now
    the first BURST are written, then one line says how many more were suppressed; another
    user's warning is still written. The requests reach Redis, which refuses each: the server
    reads Redis's room once, while there is some, and not again (reading it, the server would
    refuse them itself, in a sentence to the user, with no warning to write)."""
    async with running_pool(redis_server, tmp_path) as pool:
        async with pool.client("bob") as client:
            await client.call(Enqueue({"argv": ["true"]}, None), Enqueued)
        assert pool.server.listener is not None
        handlers = pool.server.listener.handlers
        handlers.admission.room.every = 3600.0
        async with memory_full(redis_server):
            await refused_enqueues(pool, "alice", FLOOD)
            assert len(warnings_written(caplog)) == BURST
            await refused_enqueues(pool, "bob", 1)
            assert "of bob refused" in warnings_written(caplog)[BURST]
            handlers.warnings.interval = 0.5  # rather than a minute: alice's allowance is back sooner
            await asyncio.sleep(handlers.warnings.interval)
            await refused_enqueues(pool, "alice", 1)
    *_, suppressed, next_one = warnings_written(caplog)
    assert suppressed == f"{FLOOD - BURST} more warnings like these from alice suppressed"
    assert "of alice refused" in next_one
    assert len(warnings_written(caplog)) == BURST + 3


def test_before_authentication_warnings_count_against_the_address_block(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """issue 44 item 5 (review of item 9): before authentication a connection's warnings counted
    against its raw address, so a host rotating through its IPv6 /64 had a fresh allowance with
    each address. They count against the block the throttle counts (a /64), as the session
    names it; a user, once known, has their own."""
    limit = LogLimit(clock=lambda: 0.0)
    logger = logging.getLogger("test_log_limit")
    with caplog.at_level(logging.WARNING, logger="test_log_limit"):
        for n in range(1, 2 * BURST + 1):
            limit.warning(logger, warned_as(None, f"2001:db8:1:2::{n:x}"), "closing a connection")
        limit.warning(logger, warned_as("alice", "2001:db8:1:2::1"), "closing a connection")
    assert [r.getMessage() for r in caplog.records].count("closing a connection") == BURST + 1
