"""Commands run inside a running job (`poolctl exec`): the worker's end of a channel.

The server tells this worker of a channel into one of its jobs with a message on the worker's
pub/sub channel (keys.channel_message); the channel's record, input and output are Redis keys,
relayed as daemon/queue/channels.py describes. The command runs in the job's allocation: spawned
as the job's first process was (spawn.py), with the job's uid, its GPUs and their confinement,
its environment (GPUs, its Python environment, GPUPOOL_*), its working directory, in its slot's
cgroup, in a session of its own. Its stdout and stderr go back apart, its stdin comes from the
client, its exit code ends the channel.

It ends when it exits; when its job's first process ends (the job's end ends everything of it
anyway: its cgroup is killed, or its uid swept); when the server asks (the client cancelled or
went away: `k`); or when its server has gone (the channel's record expired, or its `alive_until`
heartbeat is past); and, should the worker be frozen or killed, its orphan guard kills it as it
kills the job (it watches its process group under the job's lease). Every command run so is
written in the job's log as a line of the pool's own.

None starts once the job's first process has been reaped (spawn.Child.reaped): its end is being
made then, and what started after the uid's sweep or the cgroup's kill would outlive the job.
Once the command has exited, its output is relayed to the last byte however slowly its client
reads; only reaching its pipes' end (a process it left may hold them) is held to DRAIN_SECONDS.
The worker's first entry says it has taken the channel (channels.ACCEPTED), and it deletes the
input entries it has read, so Redis holds only what it has not taken yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, cast

import msgpack
from redis.exceptions import RedisError

from daemon.queue import channels, keys
from daemon.queue.connection import AnyRedis
from daemon.worker.attempt import Holdings, Phase
from daemon.worker.runner import JobRun
from daemon.worker.spawn import Child, Spawner

log = logging.getLogger(__name__)

# A channel's reason when its job is not running here (job_shell.py's ENDED: `shell` asks the job why)
NOT_RUNNING = "the job is not running on its worker any more"
DRAIN_SECONDS = 5.0  # after the command ends, how long its pipes may stay open without their end
DRAIN_POLL = 0.25  # how often, once the command has ended, to look whether its pipes are stuck
JOB_END_SECONDS = 0.5  # how long a killed command's job may take to be seen ending with it


def exit_status(child: Child, status: int, argv: list[str]) -> tuple[int, str]:
    """The exit code a shell would give (128+N for signal N; 127 and 126 for a program that could
    not run) and a sentence saying how it ended."""
    if child.start_error is not None:
        missing = child.start_error.errno == errno.ENOENT
        return (127 if missing else 126), f"cannot run {argv[0]}: {child.start_error.strerror}"
    if status < 0:
        return 128 - status, f"killed by {signal_name(-status)}"
    return status, "exited"


def signal_name(number: int) -> str:
    """The name of signal `number`: SIGTERM, SIGRTMIN+6 (real-time signals have no name of their own)."""
    with contextlib.suppress(ValueError):
        return signal.Signals(number).name
    if signal.SIGRTMIN <= number <= signal.SIGRTMAX:
        return f"SIGRTMIN+{number - signal.SIGRTMIN}"
    return f"signal {number}"


class Execs:
    """The channels into this worker's jobs: `message` hands each one its own task."""

    def __init__(
        self,
        redis: AnyRedis,
        held: Holdings,
        spawner: Spawner,
        spawn_task: Callable[[Coroutine[Any, Any, None], str], object],
    ) -> None:
        self.redis = redis
        self.held = held
        self.spawner = spawner
        self._spawn_task = spawn_task  # the worker's, so its stop cancels and awaits them

    def message(self, text: str) -> bool:
        """A message on the worker's pub/sub channel: True when it was news of a channel (now
        served), False for anything else (a nudge to heartbeat)."""
        if not text.startswith(keys.CHANNEL_MESSAGE):
            return False
        session, _, job_id = text.removeprefix(keys.CHANNEL_MESSAGE).partition(":")
        if session and job_id:
            self._spawn_task(self._serve(job_id, session), f"channel {session} into {job_id}")
        return True

    def _run_of(self, job_id: str) -> JobRun | None:
        for held in self.held:
            run = held.run
            if held.lease.job_id == job_id and held.phase is Phase.RUNNING and isinstance(run, JobRun):
                first = run.first_process
                if first is not None and not first.reaped:  # once reaped, its end is being made
                    return run
        return None

    def _starting(self, job_id: str) -> bool:
        """Whether the job is held here but its first process not spawned yet."""
        return any(
            held.lease.job_id == job_id
            and held.phase is Phase.RUNNING
            and isinstance(held.run, JobRun)
            and held.run.first_process is None
            for held in self.held
        )

    async def _serve(self, job_id: str, session: str) -> None:
        try:
            await self._serve_in(job_id, session)
        except (RedisError, OSError) as exc:  # the channel's, not the worker's: it goes on
            log.warning("channel %s into job %s failed: %s", session, job_id, exc)
        except Exception:  # a fault of this module's: the channel's all the same (its end is written)
            log.exception("channel %s into job %s failed", session, job_id)

    async def _serve_in(self, job_id: str, session: str) -> None:
        # Taken once: its server tells again when it has not heard from the worker yet (channels.py).
        key = keys.channel(job_id, session)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(key)
            pipe.hsetnx(key, "taken", "1")
            pipe.expire(key, channels.CHANNEL_IDLE)  # were it gone, the key `taken` made goes too
            found, first, _ = await pipe.execute()
        record = cast(dict[bytes, bytes], found)
        if not record:
            return  # expired: its server has gone
        if not first:
            return  # served already, by this worker's first telling
        out = keys.channel_out(job_id, session)
        await channels.append(self.redis, out, {channels.ACCEPTED: b"1"})  # its server stops telling
        # From here to the command's start, nothing awaits: the job cannot be reaped in between.
        run = self._run_of(job_id)
        if run is None:
            why = NOT_RUNNING
            if self._starting(job_id):  # (job_shell.py's NOT_STARTED: a shell tries again)
                why = "the job's program is not started yet (its code, data or environment comes first)"
            await channels.append(self.redis, out, {b"x": b"", b"r": why.encode()})
            return
        command: ExecCommand
        if record.get(b"kind") == b"forward":  # a TCP connection, not a command: forwards.py
            from daemon.worker.forwards import Forward  # noqa: PLC0415 - it builds on this module

            command = Forward(self.redis, job_id, session, run, port=int(record[b"port"]))
        elif record.get(b"kind") == b"attach":  # its terminal, not a command: attach.py
            from daemon.worker.attach import Attach  # noqa: PLC0415 - it builds on this module

            size = (int(record.get(b"rows", b"0")), int(record.get(b"cols", b"0")))
            command = Attach(self.redis, job_id, session, run, size=size)
        else:
            argv = [str(arg) for arg in msgpack.unpackb(record[b"argv"])]
            command = ExecCommand(self.redis, job_id, session, run, argv=argv, stdin=record[b"stdin"] == b"1")
        await command.run(self.spawner, record[b"user"].decode())


class ExecCommand:
    """One command run inside a job, relayed through its channel's Streams until it has ended."""

    def __init__(
        self, redis: AnyRedis, job_id: str, session: str, run: JobRun, *, argv: list[str], stdin: bool
    ) -> None:
        self.redis = redis
        self.job_id = job_id
        self.session = session
        self.run_ = run
        self.argv = argv
        self.stdin = stdin
        self.out = keys.channel_out(job_id, session)
        self.writes = channels.Writes(redis)  # output, credit and the end, in order; input read
        self._unread: deque[int] = deque()  # sizes of the output entries the server has not taken
        self._unread_bytes = 0
        self._taken = asyncio.Event()  # the server took some output
        self._input: asyncio.Queue[bytes | None] = asyncio.Queue()  # for stdin; None: its end
        self._reading: dict[bytes, float] = {}  # pumps waiting for their pipe: since when (loop time)

    async def run(self, spawner: Spawner, user: str) -> None:
        """Run the command until it has ended, then write its end: always, whatever failed (its
        server waits for that entry until the job ends)."""
        code, why = b"", "the worker failed to relay it"
        try:
            status, why = await self._run(spawner, user)
            code = str(status).encode()
            log.info("exec by %s in job %s ended: %s (%d)", user, self.job_id, why, status)
        finally:
            await self.end(code, why)

    async def end(self, code: bytes, why: str) -> None:
        """Write the channel's end (`x`) after all output and credit put before it, and stop."""
        try:
            with contextlib.suppress(Exception):  # Redis gone: its server ends the channel with the job
                self.writes.append(self.out, {b"x": code, b"r": why.encode()})
                await asyncio.shield(self.writes.written())
        finally:
            await self.writes.close()

    async def _run(self, spawner: Spawner, user: str) -> tuple[int, str]:
        run = self.run_
        job = run.first_process
        assert job is not None
        stdin_read, stdin_write = os.pipe() if self.stdin else (-1, -1)
        minors = [g.minor for g in run.gpus]
        try:
            child = spawner.spawn_in_job(
                self.argv,
                cwd=run.cwd,
                env=run.env,
                identity=run.identity,
                cgroup=run.cgroup,
                gpus=None if None in minors else {m for m in minors if m is not None},
                stdin=stdin_read if self.stdin else None,
                job=job,
            )
        except OSError as exc:
            if stdin_write >= 0:
                os.close(stdin_write)
            return 126, f"cannot start {self.argv[0]}: {exc.strerror}"
        finally:
            if stdin_read >= 0:
                os.close(stdin_read)
        if run.guard is not None:  # a frozen or killed worker's guard kills it as it kills the job
            run.guard.watch(child.pid, run.lease.id)
        shown = channels.shown(self.argv)  # escaped: a newline in an argument forges no log line
        run.output.note(f"exec by {user} (pid {child.pid}): {shown}")
        log.info("exec by %s in job %s (pid %d): %s", user, self.job_id, child.pid, shown)
        pumps = [
            asyncio.ensure_future(self._pump(child.output, b"o")),
            asyncio.ensure_future(self._pump(child.errors, b"s")),
        ]
        inbound = asyncio.ensure_future(self._inbound())
        feed = asyncio.ensure_future(self._feed(stdin_write)) if stdin_write >= 0 else None
        helpers: list[asyncio.Future[Any]] = [*pumps, inbound, *([feed] if feed else [])]
        try:
            return await self._until_ended(child, job, inbound, pumps)
        finally:
            if run.guard is not None:
                run.guard.forget(child.pid)
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)

    async def _until_ended(
        self, child: Child, job: Child, inbound: asyncio.Future[str], pumps: list[asyncio.Task[None]]
    ) -> tuple[int, str]:
        ended: asyncio.Future[int] = asyncio.ensure_future(child.wait())
        job_ended: asyncio.Future[int] = asyncio.ensure_future(job.wait())
        watched: set[asyncio.Future[Any]] = {ended, job_ended, inbound}
        try:
            await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            killed_why = None
            if not ended.done():
                killed_why = "the job ended" if job_ended.done() else inbound.result()
                _kill_group(child.pid)
            status = await ended
            _kill_group(child.pid)  # what it left running in its process group goes with it
            if status < 0 and killed_why is None:  # killed: by its job's end, the job's cgroup?
                await asyncio.wait({job_ended}, timeout=JOB_END_SECONDS)
                killed_why = "the job ended" if job_ended.done() else None
            await self._drain(pumps, inbound)
            code, why = exit_status(child, status, self.argv)
            return (code, f"{why} ({killed_why})") if killed_why else (code, why)
        finally:
            job_ended.cancel()
            if not ended.done():  # this task was cancelled (the worker stops): the command goes too
                _kill_group(child.pid)

    async def _drain(self, pumps: list[asyncio.Task[None]], inbound: asyncio.Future[str]) -> None:
        """Once the command has ended: wait until its pumps have relayed all it wrote. Only
        reaching their pipes' end is held to DRAIN_SECONDS (a process it left, detached, may keep
        them open); waiting for the client to take the output is not (a slow reader gets every
        byte), and ends only when the server asks (`k`) or has gone."""
        loop = asyncio.get_running_loop()
        ended_at = loop.time()
        pending: set[asyncio.Future[Any]] = set(pumps)
        while pending - {inbound}:
            if inbound.done():
                return
            _, pending = await asyncio.wait(pending | {inbound}, timeout=DRAIN_POLL)
            now = loop.time()
            if any(now - max(since, ended_at) >= DRAIN_SECONDS for since in self._reading.values()):
                return

    async def _pump(self, fd: int, tag: bytes) -> None:
        """Relay pipe `fd` as entries `tag=BYTES`, within the window the server acknowledges."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=channels.READ_CHUNK, loop=loop)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader, loop=loop), os.fdopen(fd, "rb", buffering=0)
        )
        try:
            await self._relay(reader, tag)
        finally:
            transport.close()

    async def _relay(self, reader: asyncio.StreamReader, tag: bytes) -> None:
        """Relay what `reader` reads, until its end, as entries `tag=BYTES` within the window."""
        while True:
            while self._unread_bytes >= channels.OUT_WINDOW or len(self._unread) >= channels.OUT_ENTRIES:
                self._taken.clear()
                await self._taken.wait()
            self._reading[tag] = asyncio.get_running_loop().time()
            try:
                data = await reader.read(min(channels.READ_CHUNK, channels.OUT_WINDOW - self._unread_bytes))
            finally:
                del self._reading[tag]
            if not data:
                return
            self._unread.append(len(data))
            self._unread_bytes += len(data)
            self.writes.append(self.out, {tag: data})

    async def _inbound(self) -> str:
        """Read what the server relays until it asks for a kill; returns why. Also returns when
        its server has gone: the channel's record gone, or its `alive_until` (the server's
        heartbeat, epoch seconds) past. Each entry read is deleted (with the next write): Redis
        holds only what the worker has not taken yet."""
        record = keys.channel(self.job_id, self.session)
        source = keys.channel_in(self.job_id, self.session)
        after = "0-0"
        while True:
            entries = await channels.read(self.redis, source, after)
            if not entries and not await self._server_alive(record):
                return "its channel's server went away"
            if entries:
                after = entries[-1][0].decode()
                self.writes.delete(source, [entry_id for entry_id, _ in entries])
            for _, fields in entries:
                if (data := fields.get(b"d")) is not None:
                    self._input.put_nowait(data)  # bounded by the client's window (its credit)
                elif b"e" in fields:
                    self._input.put_nowait(None)
                elif (count := fields.get(b"a")) is not None:
                    for _ in range(min(int(count), len(self._unread))):
                        self._unread_bytes -= self._unread.popleft()
                    self._taken.set()
                elif (size := fields.get(b"w")) is not None:  # an attach's window: each applied is said
                    rows, _, cols = size.partition(b"x")
                    self._resize(int(rows), int(cols))
                    self.writes.append(self.out, {b"c": b"0"})  # (in order with the credit before it)
                elif (why := fields.get(b"k")) is not None:
                    return why.decode()

    def _resize(self, rows: int, cols: int) -> None:
        """The client's terminal is `rows` x `cols` now: only a terminal's channel (attach.py) has one."""

    async def _server_alive(self, record: str) -> bool:
        kind, alive_until = await self.redis.hmget(record, ["kind", "alive_until"])
        if kind is None:
            return False  # the record expired, or its server deleted it
        return alive_until is None or float(alive_until) >= time.time()

    async def _feed(self, fd: int) -> None:
        """Write the client's input into the command's stdin, crediting each piece once written (or
        dropped: a command that closed its stdin takes no more, and its client must not wait)."""
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(fd, "wb", buffering=0)
        )
        writer = asyncio.StreamWriter(transport, protocol, None, loop)
        try:
            while (data := await self._input.get()) is not None:
                with contextlib.suppress(ConnectionError):
                    writer.write(data)
                    await writer.drain()
                self.writes.append(self.out, {b"c": str(len(data)).encode()})
        finally:
            transport.close()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
