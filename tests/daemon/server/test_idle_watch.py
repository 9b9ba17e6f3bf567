"""The one timer that watches a connection's reads (daemon/server/idle_watch.py) keeps the
semantics of a timeout around each read: a read waits no longer than its deadline as it stands
when the read begins, even when that deadline is nearer than the one the timer was set for, and
a cancellation from anyone else stays a cancellation. The server-level behaviour (handshake and
idle timeouts of a real poold) is in test_server_hostile.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine

from daemon.server.idle_watch import IdleWatch

BOUND = 5.0  # no test waits longer than this for a read to end, whatever the watch does


async def read_twice(first_deadline: float, then_idle: float) -> str:
    """Like a connection's read loop: a first read under a far deadline (the handshake's), that
    gets its bytes at once; then reads under `then_idle` seconds from each read's start."""
    reader = asyncio.StreamReader()
    authenticated = False
    loop = asyncio.get_running_loop()
    far = loop.time() + first_deadline

    def deadline(started: float) -> float:
        return started + then_idle if authenticated else far

    watch = IdleWatch(deadline)
    try:
        reader.feed_data(b"hello")
        assert await watch.read(reader, 100) == b"hello"
        authenticated = True
        started = loop.time()
        try:
            await watch.read(reader, 100)
        except TimeoutError:
            return f"timed out after {loop.time() - started:.2f} s"
        return "read returned"
    finally:
        watch.close()


async def until_done(coro: Coroutine[object, object, str]) -> str:
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=BOUND)
    if task not in done:
        task.cancel()
        return f"still waiting after {BOUND} s"
    return task.result()


async def test_a_read_after_the_handshake_waits_only_the_idle_timeout() -> None:
    """The timer was set for the handshake's deadline (60 s away); once authenticated, a silent
    connection's read must end at the idle timeout (0.2 s), not when the old timer would fire."""
    outcome = await until_done(read_twice(first_deadline=60, then_idle=0.2))
    assert outcome.startswith("timed out after"), outcome
    assert 0.15 < float(outcome.split()[3]) < 3, outcome


async def test_a_later_deadline_than_the_timer_is_still_kept() -> None:
    """A first deadline nearer than the idle one (0.1 s, then 0.4 s): the read waits the full
    idle timeout, the timer setting itself again when it fires early."""
    outcome = await until_done(read_twice(first_deadline=0.1, then_idle=0.4))
    assert outcome.startswith("timed out after"), outcome
    assert 0.35 < float(outcome.split()[3]) < 3, outcome


async def test_someone_elses_cancel_stays_a_cancel() -> None:
    """A read cancelled from outside (the server stopping) raises CancelledError, not TimeoutError,
    even when the watch's deadline passes in the same step (made so here: the watch's timer, as
    it cancels the read, is followed at once by a cancel from outside)."""

    async def read_forever() -> str:
        watch = IdleWatch(lambda started: started + 0.05)
        look = watch._look

        def look_then_cancel() -> None:
            look()
            task.cancel()

        watch._look = look_then_cancel  # type: ignore[method-assign]
        try:
            await watch.read(asyncio.StreamReader(), 100)
        finally:
            watch.close()
        return "read returned"

    task = asyncio.ensure_future(read_forever())
    done, _ = await asyncio.wait({task}, timeout=BOUND)
    assert task in done
    assert task.cancelled()


async def test_a_task_already_being_cancelled_once_still_gets_its_timeout() -> None:
    """The watch counts only its own cancel, as asyncio.timeout does: a task that swallowed an
    earlier cancel (cancelling() == 1) still sees a TimeoutError when its read waits too long."""

    async def swallow_then_read() -> str:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0)
        assert task.cancelling() == 1
        watch = IdleWatch(lambda started: started + 0.1)
        try:
            await watch.read(asyncio.StreamReader(), 100)
        except TimeoutError:
            return "timed out"
        finally:
            watch.close()
        return "read returned"

    assert await until_done(swallow_then_read()) == "timed out"
