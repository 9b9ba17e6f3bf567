"""`poolctl exec JOB -- CMD`: a command run inside a running job, over a channel (docs/PROTOCOL.md
§5): its stdout and stderr written here as they come, its exit status poolctl's own.

Standard input that is not a terminal (a pipe, a file) is sent to the command, then its end; a
terminal's is not read (the command's stdin is empty): an interactive terminal is `poolctl shell`'s.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator

from daemon.aio import in_daemon_thread
from daemon.client.pool_client import PoolClient
from daemon.ctl.parsing import UsageError
from protocol import OpenChannel

READ_SIZE = 64 * 1024
EXITED = "exited"  # ChannelClosed's reason for a command that exited by itself
EXIT_NO_CODE = 1  # the command never gave one: it could not start, or its job ended under it
EXIT_BROKEN_PIPE = 128 + 13  # our output's reader went (`| head`): the command is killed, as by SIGPIPE


async def run(client: PoolClient, job_id: str, argv: list[str]) -> int:
    """Run `argv` in job `job_id`; the command's exit code."""
    argv = argv[1:] if argv[:1] == ["--"] else argv
    if not argv:
        raise UsageError("exec needs a command: poolctl exec JOB -- COMMAND [ARG...]")
    piped = not os.isatty(0)
    try:
        closed = await client.channel(
            OpenChannel(job_id, "exec", argv, stdin=piped), _write, _stdin() if piped else None
        )
    except BrokenPipeError:  # the channel is cancelled: the server has the command killed
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # so that the exit's flush of stdout is quiet
        return EXIT_BROKEN_PIPE
    if closed.reason != EXITED:  # killed, or never started: say why
        print(f"poolctl: {argv[0]} in {job_id}: {closed.reason}", file=sys.stderr)
    return EXIT_NO_CODE if closed.exit_code is None else closed.exit_code


async def _write(stream: str, data: bytes) -> None:
    out = sys.stderr.buffer if stream == "stderr" else sys.stdout.buffer
    out.write(data)
    out.flush()


async def _stdin() -> AsyncIterator[bytes]:
    """Our stdin, read in a daemon thread: a read that never returns (a pipe whose writer is
    idle) must not keep poolctl from exiting once the command has ended."""
    while data := await in_daemon_thread(lambda: os.read(0, READ_SIZE), "poolctl exec stdin"):
        yield data
