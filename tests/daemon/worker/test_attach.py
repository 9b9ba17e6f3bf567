"""attach.py: a client's attach to a tty job's terminal, its end as the client is told it.

The attach here is the worker's own class on a real terminal (terminal.py), a real first process
(spawn.py) and a real Redis channel; the job run around them is reduced to what an attach reads
of it (its terminal, its first process, its output's notes and what stopped it)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from redis.asyncio import Redis

from daemon.queue import keys
from daemon.worker.attach import Attach
from daemon.worker.runner import JobRun
from daemon.worker.spawn import Child, Spawner
from daemon.worker.terminal import Terminal

ENV = {"PATH": "/usr/bin:/bin"}
ENDED = "not running on its worker any more"  # job_shell.py's: the client asks the job why


@dataclass
class _Notes:
    said: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        self.said.append(text)


@dataclass
class _Run:
    """What an attach reads of its job's run (runner.JobRun)."""

    terminal: Terminal
    first_process: Child
    output: _Notes = field(default_factory=_Notes)
    ending: None = None
    stopped_why: str = ""


async def channel_end(redis: Redis, job_id: str, session: str) -> dict[bytes, bytes]:
    """The channel's end (`x`, `r`) as the worker wrote it for its server."""
    async with asyncio.timeout(15):
        while True:
            entries = cast(
                list[tuple[bytes, dict[bytes, bytes]]], await redis.xrange(keys.channel_out(job_id, session))
            )
            for _, fields in entries:
                if b"x" in fields:
                    return fields
            await asyncio.sleep(0.05)


def read_terminal(terminal: Terminal) -> int:
    """The terminal's output read as the job's output reads it (job_output.py), its end told."""
    fd = terminal.output_fd()
    os.set_blocking(fd, False)
    loop = asyncio.get_running_loop()

    def readable() -> None:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError:  # EIO: every holder of the slave has closed it
            data = b""
        if not data:
            loop.remove_reader(fd)
        terminal.took(data)

    loop.add_reader(fd, readable)
    return fd


async def test_an_attach_to_a_job_whose_program_never_started_says_so_not_an_exit_code(
    redis: Redis, spawner: Spawner, tmp_path: Path
) -> None:
    """The attach served between a tty job's spawn and its reap, when its program could not
    start (`poolctl shell -- /nonexistent`): it said the shell exited 127, and `poolctl shell`
    exited 127 saying nothing (CI, stop 58). It says the job's program is not running, for the
    client to show why from the job's record."""
    job_id, session = "default.attachnostart", "s1"
    await redis.hset(keys.channel(job_id, session), mapping={"kind": "attach", "alive_until": "9e9"})
    for stream in (keys.channel_in(job_id, session), keys.channel_out(job_id, session)):
        await redis.xadd(stream, {"n": ""})  # both made, as its server makes them (server/channels.py)
    terminal = Terminal(idle_limit=600, idle=lambda limit: None)
    child = spawner.spawn(["/nonexistent"], cwd=tmp_path, env=ENV, terminal=terminal.slave)
    terminal.close_slave()
    reading = read_terminal(terminal)
    try:
        run = _Run(terminal, child)  # spawned, not reaped: the attach comes in between
        attach = Attach(redis, job_id, session, cast(JobRun, run), size=(24, 80))
        serving = asyncio.ensure_future(attach.run(spawner, "alice"))
        end = await channel_end(redis, job_id, session)
        await asyncio.wait_for(serving, 15)
        assert child.start_error is not None
        assert end[b"x"] == b""
        assert ENDED in end[b"r"].decode(), end
        assert "did not start" in end[b"r"].decode(), end
    finally:
        asyncio.get_running_loop().remove_reader(reading)
        os.close(reading)
        terminal.close()
