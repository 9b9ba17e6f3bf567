"""A channel's relay through Redis: how the server and the worker running a job talk about one
channel into it (`poolctl exec`), with nothing new to open on the worker.

The server (server/channels.py) writes the channel's record (keys.channel) and tells the job's
worker with a message on the worker's pub/sub channel (keys.channel_message); from then on each
side appends to one Stream and reads the other's:

  in   (server → worker)  d=BYTES  the client's input           e=1   the input has ended
                          a=N      N more output entries taken   k=WHY kill the command (an
                                                                       attach: detach, not kill)
                          w=RxC    an attach's terminal is now R rows by C columns
  out  (worker → server)  o=BYTES  stdout    s=BYTES  stderr     c=N   N bytes of input taken
                                                                       (one per d; c=0 per w)
                          x=CODE   the end: exit code ('' none)  r=WHY how it ended (with x)
                          t=1      taken: the worker's first entry, written at once (a server
                                   that hears nothing for a while gives up on the worker)
                          e=1      the output has ended, the input goes on (a forward's
                                   connection, half-closed by the job's end)

Both directions are held to a window, so Redis holds at most that much of one channel whatever
its ends do: the worker has at most OUT_WINDOW bytes and OUT_ENTRIES entries of output not yet
taken by the server (`a`), which takes output only as its client acknowledges it; the server has
at most IN_ENTRIES entries of input not yet taken by the worker (`c`, one per `d` or `w`), and the
client's window bounds their bytes. Each reader deletes what it has read (with its next write:
Writes), each append is capped all the same (MAXLEN: the windows and a few entries of control,
the newest kept), and each key expires
CHANNEL_IDLE after its last write: a channel whose ends have both gone leaves nothing. The server
makes both Streams (empty) when it opens the channel and deletes them at its end; an append never
makes one again (NOMKSTREAM), so a late write of the worker's leaves nothing behind either.

Speed: an end never waits for Redis between two of its writes (Writes: what it writes while one
is on its way leaves together in the next), and the server acknowledges output (`a`) as it takes
it from Redis, not once its client has it: the worker fills Redis again while the server waits
for its client, so a window moves in a round trip or two rather than an entry in one.

The server beats while the channel is open: it moves the record's `alive_until` (epoch seconds)
ahead every few seconds; a worker ends a channel on a `k`, or once its record has gone or its
`alive_until` has passed.
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Mapping, Sequence
from typing import Any, Final

from daemon.aio import cancel_and_wait
from daemon.queue.connection import AnyRedis
from daemon.queue.reads import Entries, xread
from protocol import CHANNEL_WINDOW

OUT_WINDOW: Final = CHANNEL_WINDOW
OUT_ENTRIES: Final = 64
IN_ENTRIES: Final = 64
ACCEPTED: Final = b"t"  # the worker's first entry in `out`: it has the channel (nothing to relay)
READ_CHUNK: Final = 64 * 1024  # the most one output entry carries
# At most this many entries of a Stream are unread: OUT_ENTRIES of output and IN_ENTRIES of
# credit (out), or IN_ENTRIES of input and OUT_ENTRIES acknowledgements (in), and a few of
# control (t, x; e, k). MAXLEN keeps the newest, so a reader that does not delete loses nothing.
MAXLEN: Final = OUT_ENTRIES + IN_ENTRIES + 8
CHANNEL_IDLE: Final = 30  # seconds: the server refreshes the record more often while it relays
BLOCK: Final = 1.0  # seconds a blocking read waits at most: each side looks at its other end then


async def append(redis: AnyRedis, key: str, entry: Mapping[bytes, bytes]) -> None:
    """Append `entry` to the channel's Stream `key`, and keep the key CHANNEL_IDLE from now."""
    async with redis.pipeline(transaction=False) as pipe:
        add_entry(pipe, key, entry)
        await pipe.execute()


def add_entry(pipe: Any, key: str, entry: Mapping[bytes, bytes]) -> None:
    """Queue on `pipe` what `append` does: the entry, capped, into the Stream if it is still
    there (its channel's end deletes it), and the key kept CHANNEL_IDLE from now."""
    pipe.xadd(key, dict(entry), maxlen=MAXLEN, approximate=False, nomkstream=True)
    pipe.expire(key, CHANNEL_IDLE)


async def read(redis: AnyRedis, key: str, after: str, block: float = BLOCK) -> Entries:
    """The entries of Stream `key` after entry `after` ("0-0": all), waiting up to `block` seconds
    for one; [] when none came."""
    answer = await xread(redis, {key: after}, block=block, count=OUT_ENTRIES)
    return answer[0][1] if answer else []


class Writes:
    """One end's writes to its channel's Streams, in the order made, without a round trip each:
    what is written while a write is on its way leaves with the next one, all in one pipeline.
    So an end goes on reading its source (a command's pipe, a connection, its other Stream) while
    Redis answers, and a window's entries cost a round trip or two, not one each. What is queued
    here is bounded by its writer's window (input entries by IN_ENTRIES): nothing piles up."""

    def __init__(self, redis: AnyRedis) -> None:
        self.redis = redis
        self._queued: list[tuple[str, Any]] = []  # (key, an entry to append, or entry ids to delete)
        self._writing: asyncio.Task[None] | None = None
        self._failed: Exception | None = None

    def append(self, key: str, entry: Mapping[bytes, bytes]) -> None:
        """Append `entry` to Stream `key` (as `append` does); raises what an earlier write failed
        with (Redis gone)."""
        self._queue(key, dict(entry))

    def delete(self, key: str, entry_ids: Sequence[bytes]) -> None:
        """Delete entries `entry_ids` (read, and taken) from Stream `key`."""
        if entry_ids:
            self._queue(key, tuple(entry_ids))

    async def written(self) -> None:
        """Wait until everything written so far is in Redis (or has failed: that is raised)."""
        while self._writing is not None:
            await asyncio.shield(self._writing)
        if self._failed is not None:
            raise self._failed

    async def close(self) -> None:
        """Stop: what is queued and not yet written is dropped."""
        if self._writing is not None:
            await cancel_and_wait(self._writing)

    def _queue(self, key: str, what: Any) -> None:
        if self._failed is not None:
            raise self._failed
        self._queued.append((key, what))
        if self._writing is None:
            self._writing = asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        try:
            # A turn of the loop first: what the writer wakes by this turn's writes (a pump that
            # an acknowledgement read and deleted lets read again) joins them, rather than wait
            # a round trip for the next write.
            await asyncio.sleep(0)
            while self._queued:
                batch, self._queued = self._queued, []
                async with self.redis.pipeline(transaction=False) as pipe:
                    appended = set()
                    for key, what in batch:
                        if isinstance(what, tuple):
                            pipe.xdel(key, *what)
                        else:
                            pipe.xadd(key, what, maxlen=MAXLEN, approximate=False, nomkstream=True)
                            appended.add(key)
                    for key in appended:
                        pipe.expire(key, CHANNEL_IDLE)
                    await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - not hidden: the next write, or written(), raises it
            self._failed = exc
            self._queued.clear()
        finally:
            self._writing = None


def shown(argv: list[str], limit: int = 500) -> str:
    """`argv` for a log line: shell-quoted, its control characters escaped (no newline may forge a
    line), at most `limit` characters."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in shlex.join(argv))
    return text if len(text) <= limit else text[:limit] + f"... ({len(argv)} arguments)"
