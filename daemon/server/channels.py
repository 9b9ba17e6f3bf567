"""The server's end of a channel into a running job (`poolctl exec`, `forward`, `attach`): a relay
between the client's connection and the job's worker, through Redis (daemon/queue/channels.py).

`ClientEnd` is what the client's session (session.py) hands a channel: the client's input as it
comes (ChannelData, ChannelEnd, ChannelAck events of its connection), the room its window has for
output, and the way to send. `open_channel` authorises the channel, writes its record, tells the
job's worker, and relays both ways until the command has ended (its exit code is the reply), the
job has, or the client cancels or goes away (the worker is then told to kill the command; an
attach's worker detaches instead: the shell lives on).

Time: every byte relayed counts against its user's share (relay_budget.py), so one user's channels
cannot take the server from everyone else.

Memory: the client's input waits here at most one window (the protocol's: the client is credited
only once the worker has written it into the command). Output is taken from Redis a read at a
time, at most the worker's window (channels.OUT_WINDOW), and the next read waits until the
client's window has taken all of the last: at most a window of output waits here.

Speed: neither end waits for Redis between its writes (channels.Writes), and output is
acknowledged to the worker as soon as it is taken from Redis, so the worker fills Redis again
while this end waits for the client's window: a window each way moves in about a round trip.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgpack

from daemon.aio import cancel_and_wait
from daemon.errors import GpupoolError
from daemon.job import JobInfo, JobState, is_agent_worker
from daemon.queue import channels, keys
from daemon.queue.job_queue import JobQueue
from daemon.server.relay_budget import RelayBudget
from protocol import ChannelClosed, ChannelOutput, ErrorCode, OpenChannel, StreamItem
from protocol.channels import Channel

log = logging.getLogger(__name__)

# A command run in the job; a TCP connection to its port; its terminal (a tty job's: `poolctl shell`).
KINDS = frozenset({"exec", "forward", "attach"})
MAX_ARGV_BYTES = 128 * 1024  # a command line longer than this is no command typed at a prompt
MAX_ARGS = 4096  # nor is one of more arguments than this
HEARTBEAT_SECONDS = 3.0  # how often an open channel's keys are kept alive and its job looked at
ALIVE_SECONDS = 10.0  # the record's `alive_until`: a worker ends a channel whose server stops beating
ENDED_LOOKS = 2  # looks that found the job ended and no exit from its worker: the channel ends
ANSWER_SECONDS = 10.0  # a worker that has written nothing this long after the news never will
CLOSE_SECONDS = 5.0  # the most a channel's end waits for Redis (its keys expire by themselves)
KILL_LINGER = 2  # seconds the input Stream stays after a kill: the worker's next read takes it


class ClientEnd:
    """The client's side of one open channel, as its session feeds it."""

    def __init__(
        self,
        send: Callable[[StreamItem], Awaitable[None]],
        output_room: Callable[[], int],
        credit: Callable[[int], None],
    ) -> None:
        self.send = send
        self.output_room = output_room
        self.credit = credit
        self.input = bytearray()  # received, not yet relayed: within the protocol's window
        self.input_ended = False
        self.size: tuple[int, int] | None = None  # a terminal's new size, not yet relayed
        self.input_changed = asyncio.Event()
        self.room_changed = asyncio.Event()

    def received(self, data: bytes) -> None:
        self.input += data
        self.input_changed.set()

    def ended(self) -> None:
        self.input_ended = True
        self.input_changed.set()

    def acked(self) -> None:
        self.room_changed.set()

    def resized(self, rows: int, cols: int) -> None:
        self.size = (rows, cols)  # only the newest matters: a burst of them is one `w`
        self.input_changed.set()


def check_request(request: OpenChannel) -> None:
    if request.kind not in KINDS:
        raise GpupoolError(
            f"no channel of kind {request.kind!r}; this server opens {', '.join(sorted(KINDS))}",
            ErrorCode.INVALID_ARGUMENT,
        )
    if request.kind == "attach":
        if request.argv or not request.stdin or request.port:
            raise GpupoolError(
                "an attach reaches a job's terminal and runs no command", ErrorCode.INVALID_ARGUMENT
            )
        if Channel.resize(request.rows, request.cols) is not None and (request.rows, request.cols) != (0, 0):
            raise GpupoolError(
                f"a terminal of {request.rows}x{request.cols}; rows and cols are 1 to 65535 (or both 0)",
                ErrorCode.INVALID_ARGUMENT,
            )
        return
    if request.kind == "forward":
        if not 0 < request.port < 65536 or request.argv or not request.stdin:
            raise GpupoolError(
                f"a forward reaches a TCP port (1 to 65535, not {request.port}) and runs no command",
                ErrorCode.INVALID_ARGUMENT,
            )
        return
    if not request.argv or not request.argv[0]:
        raise GpupoolError("exec needs a command: poolctl exec JOB -- COMMAND", ErrorCode.INVALID_ARGUMENT)
    size = sum(len(arg.encode()) + 1 for arg in request.argv)  # each with its NUL, as execve counts
    if len(request.argv) > MAX_ARGS or size > MAX_ARGV_BYTES or any("\0" in a for a in request.argv):
        raise GpupoolError(
            f"the command is over {MAX_ARGV_BYTES // 1024} KiB or {MAX_ARGS} arguments, or holds a NUL "
            "byte; pass long input on stdin",
            ErrorCode.INVALID_ARGUMENT,
        )


# What each kind of channel does, for the sentences that refuse one.
DOES = {
    "exec": "exec runs a command",
    "forward": "forward reaches a port",
    "attach": "attach reaches a shell",
}
INSTEAD = {
    "exec": "run the command from the job itself",
    "forward": "serve the port from the pool's own workers",
    "attach": "start the shell on the pool's own workers",
}


def check_running(info: JobInfo, kind: str = "exec") -> None:
    """Refuse a channel into a job that is not running on a worker of the pool's own."""
    if info.state is not JobState.RUNNING:
        raise GpupoolError(
            f"job {info.id} is {info.state}, not running: {DOES[kind]} inside a running job",
            ErrorCode.CONFLICT,
        )
    if is_agent_worker(info.worker):
        raise GpupoolError(
            f"job {info.id} runs on an agent's machine ({info.worker}), where {kind} is not supported "
            f"yet; {INSTEAD[kind]}",
            ErrorCode.INVALID_ARGUMENT,
        )
    if kind == "attach" and not info.spec.tty:
        raise GpupoolError(
            f"job {info.id} has no terminal (only a `poolctl shell` job has one); run a command in it "
            f"with `poolctl exec {info.id} -- COMMAND`",
            ErrorCode.INVALID_ARGUMENT,
        )


class Relay:
    """One channel's relay between its client (`client`) and its job's worker, through Redis."""

    def __init__(
        self,
        queue: JobQueue,
        info: JobInfo,
        request: OpenChannel,
        user: str,
        *,
        client: ClientEnd,
        budget: RelayBudget,
    ) -> None:
        """`budget`: every user's share of what the server relays (relay_budget.py)."""
        self.queue = queue
        self.budget = budget
        self.redis = queue.redis
        self.info = info
        self.request = request
        self.user = user
        self.client = client
        self.session = secrets.token_hex(8)
        job_id = info.id
        self.record = keys.channel(job_id, self.session)
        self.to_worker = keys.channel_in(job_id, self.session)
        self.from_worker = keys.channel_out(job_id, self.session)
        self.writes = channels.Writes(self.redis)  # input and acknowledgements, without a round trip each
        self._input_entries = 0  # input entries the worker has not credited yet
        self._relayed = 0  # bytes, both ways
        self._ended = False  # the command has ended (`x`), or its job has: nothing is left to kill

    async def run(self) -> ChannelClosed:
        """Relay until the channel ends; its end (the keys deleted, the worker told to kill what
        is left) runs to completion however often this task is cancelled meanwhile: a client's
        cancel and its connection's end each cancel it, and no helper may outlive it."""
        await self._open()
        helpers = [asyncio.ensure_future(h) for h in (self._down(), self._watch(), self._up())]
        try:
            waiting: set[asyncio.Future[Any]] = set(helpers)
            while True:
                done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for helper in done:  # a helper's failure (Redis gone) is the channel's
                    if isinstance(closed := helper.result(), ChannelClosed):
                        return closed
        finally:
            await _finish(self._close(helpers))

    async def _close(self, helpers: Sequence[asyncio.Future[Any]]) -> None:
        for helper in helpers:
            await cancel_and_wait(helper)
        await self.writes.close()
        how = "ended" if self._ended else "detached" if self.request.kind == "attach" else "cancelled"
        log.info(
            "%s by %s in job %s (channel %s) %s: %d bytes relayed",
            self.request.kind,
            self.user,
            self.info.id,
            self.session,
            how,
            self._relayed,
        )
        async with asyncio.timeout(CLOSE_SECONDS):  # Redis gone: the keys expire by themselves
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.delete(self.record, self.from_worker)
                if self._ended:
                    pipe.delete(self.to_worker)
                else:  # the command may still run: the worker kills it, and its input goes soon
                    channels.add_entry(pipe, self.to_worker, {b"k": b"the client went away"})
                    pipe.expire(self.to_worker, KILL_LINGER)
                await pipe.execute()

    async def _open(self) -> None:
        argv = self.request.argv
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(
                self.record,
                mapping={
                    "kind": self.request.kind,
                    "argv": msgpack.packb(argv),
                    "stdin": "1" if self.request.stdin else "0",
                    "port": str(self.request.port),
                    "rows": str(self.request.rows),
                    "cols": str(self.request.cols),
                    "user": self.user,
                    "worker": self.info.worker,
                    "created": str(time.time()),
                    "alive_until": str(time.time() + ALIVE_SECONDS),
                },
            )
            for stream in (self.to_worker, self.from_worker):  # both made now, and empty: an append
                pipe.xadd(stream, {"n": ""})  # (NOMKSTREAM) after the end makes no key again
                pipe.xtrim(stream, maxlen=0, approximate=False)
            for key in (self.record, self.to_worker, self.from_worker):
                pipe.expire(key, channels.CHANNEL_IDLE)
            await pipe.execute()
        what = {"forward": f"to port {self.request.port}", "attach": "to its terminal"}.get(
            self.request.kind, channels.shown(argv)
        )
        log.info(
            "%s by %s in job %s on worker %s (channel %s): %s",
            self.request.kind,
            self.user,
            self.info.id,
            self.info.worker,
            self.session,
            what,
        )
        await self._tell_worker()

    async def _tell_worker(self) -> None:
        message = keys.channel_message(self.info.id, self.session)
        await self.redis.publish(keys.worker_channel(self.info.worker), message)

    async def _watch(self) -> ChannelClosed:
        """The server's heartbeat: keep the channel's keys from expiring while it is open, however
        long its ends are quiet (a client that reads no output for minutes), and its record's
        `alive_until` ahead (a worker ends a channel whose record has gone or whose heartbeat has
        stopped); and end the channel once its job has, even while _down waits on the client."""
        ended_looks = 0
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hset(self.record, "alive_until", str(time.time() + ALIVE_SECONDS))
                for key in (self.record, self.to_worker, self.from_worker):
                    pipe.expire(key, channels.CHANNEL_IDLE)
                await pipe.execute()
            info = await self.queue.get(self.info.id)
            ended_looks = ended_looks + 1 if info.state is not JobState.RUNNING else 0
            if ended_looks >= ENDED_LOOKS:
                return self._job_ended(info)

    async def _up(self) -> None:
        """The client's input into the worker's Stream, coalesced: at most IN_ENTRIES entries wait
        for the worker at once, whatever sizes the client sends."""
        client = self.client
        end_sent = False
        while not end_sent:
            while self._input_entries >= channels.IN_ENTRIES or not (
                client.input or client.input_ended or client.size
            ):
                client.input_changed.clear()
                await client.input_changed.wait()
            if client.size:  # an attach's terminal resized (other kinds have none: dropped)
                (rows, cols), client.size = client.size, None
                if self.request.kind == "attach":
                    self._input_entries += 1  # its `c` (of 0 bytes) says the worker applied it
                    # (through the same writes as the keys: a resize never overtakes them)
                    self.writes.append(self.to_worker, {b"w": f"{rows}x{cols}".encode()})
            elif client.input:
                data = bytes(client.input)
                client.input.clear()
                self._input_entries += 1
                await self._spend(len(data))
                self.writes.append(self.to_worker, {b"d": data})
            else:
                self.writes.append(self.to_worker, {b"e": b"1"})
                end_sent = True

    async def _down(self) -> ChannelClosed:
        """The worker's entries to the client, each as the client's window has room; the final
        reply once the command has ended (or its job has)."""
        after, heard, ended_looks = "0-0", False, 0
        give_up = asyncio.get_running_loop().time() + ANSWER_SECONDS
        while True:
            entries = await channels.read(self.redis, self.from_worker, after)
            if not entries:
                info = await self.queue.get(self.info.id)
                ended_looks = ended_looks + 1 if info.state is not JobState.RUNNING else 0
                if ended_looks >= ENDED_LOOKS:
                    return self._job_ended(info)
                if heard:
                    continue
                if asyncio.get_running_loop().time() > give_up:
                    raise GpupoolError(
                        f"the job's worker ({self.info.worker}) did not answer in {ANSWER_SECONDS:g} s; "
                        "try again, and if it goes on, see `poolctl workers`",
                        ErrorCode.CONFLICT,
                    )
                await self._tell_worker()  # it may have missed the news (resubscribing): again
                continue
            heard = True  # any entry (the worker's first is `t`, taken) is its answer
            after = entries[-1][0].decode()
            # Taken: gone from Redis, and the worker told at once (`a`), in a write of their own
            # while they wait here for the client's window: the worker fills Redis again meanwhile.
            self.writes.delete(self.from_worker, [entry_id for entry_id, _ in entries])
            if taken := sum(b"o" in fields or b"s" in fields for _, fields in entries):
                self.writes.append(self.to_worker, {b"a": str(taken).encode()})
            for _, fields in entries:
                if (closed := await self._entry(fields)) is not None:
                    return closed

    def _job_ended(self, info: JobInfo) -> ChannelClosed:
        self._ended = True  # the job's end (or its worker's) ends all of it: nothing to kill
        ended = "ended" if info.state.terminal else "lost its worker"
        return ChannelClosed(None, f"the job {ended} ({info.state})")

    async def _spend(self, size: int) -> None:
        """Count `size` bytes against the user, and wait while the user is over their share."""
        self._relayed += size
        wait = self.budget.delay(self.user, size, asyncio.get_running_loop().time())
        if wait > 0:
            await asyncio.sleep(wait)

    async def _entry(self, fields: dict[bytes, bytes]) -> ChannelClosed | None:
        client = self.client
        for tag, stream in ((b"o", "stdout"), (b"s", "stderr")):
            if (data := fields.get(tag)) is not None:
                while client.output_room() < len(data):
                    client.room_changed.clear()
                    await client.room_changed.wait()
                await self._spend(len(data))
                await client.send(ChannelOutput(stream, data))
                return None
        if b"e" in fields:  # the far end's output has ended (a forward's connection, half-closed)
            await client.send(ChannelOutput("stdout", b""))
            return None
        if (size := fields.get(b"c")) is not None:
            self._input_entries -= 1
            if int(size):  # (0: a `w` applied, which no window counts)
                client.credit(int(size))
            client.input_changed.set()
            return None
        if (code := fields.get(b"x")) is not None:
            self._ended = True
            return ChannelClosed(int(code) if code else None, fields.get(b"r", b"").decode())
        return None


async def _finish(closing: Awaitable[None]) -> None:
    """Run `closing` to its end although the task awaiting it is cancelled (again and again),
    then pass the cancellation on: a channel's end must not be cut short halfway."""
    task = asyncio.ensure_future(closing)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:  # Redis gone: its keys expire by themselves
            log.warning("a channel's end failed", exc_info=True)
    if cancelled:
        raise asyncio.CancelledError
