"""`poolctl forward JOB [LOCAL:]PORT`: TCP connections to 127.0.0.1:LOCAL here reach 127.0.0.1:PORT
as the job sees it, each over a channel of its own (docs/PROTOCOL.md §5, kind "forward") on this
client's one connection to the server, which relays it to the job's worker.

It listens once the job is known to be this user's (or an admin's) and running on a worker of
the pool's own, as the server will check again for every connection, and ends, exit 0, when the
job ends (its open connections close with it), or on Ctrl-C (130). Each channel holds one of the
user's channels on the server (32 at most, handlers.py MAX_CHANNELS_PER_USER), so at most MAX_OPEN
connections are relayed at once: enough for a browser's (a JupyterLab with several notebooks open
holds some 14), leaving the user's execs and shells theirs; more wait their turn, accepted, as a
busy server's backlog would keep them.

It serves only its own user: any local user can connect to a port on 127.0.0.1, so a connection
whose other end belongs to another uid (the kernel's socket table says, /proc/net/tcp) is
closed at once, with a line on stderr, before anything is asked of the server. Where there is no
such table (not Linux), users cannot be told apart, and poolctl says so when it starts.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import sys
from collections.abc import AsyncIterator, Callable

from daemon.client.pool_client import PoolClient
from daemon.client.session import ClientError
from daemon.ctl.parsing import UsageError
from daemon.errors import GpupoolError, NotYours
from daemon.job import is_agent_worker
from protocol import ErrorCode, JobDetail, JobEnded, OpenChannel, ShowJob, WaitJobs

MAX_OPEN = 24  # connections relayed at once: three quarters of a user's channels (handlers.py)
READ_SIZE = 64 * 1024


def ports(text: str) -> tuple[int, int]:
    """`[LOCAL:]PORT` as (LOCAL, PORT); LOCAL is PORT when not given, 0 for any free port."""
    local, _, port = text.rpartition(":")
    try:
        numbers = int(local or port), int(port)
    except ValueError:
        numbers = (-1, -1)
    if not 0 <= numbers[0] < 65536 or not 0 < numbers[1] < 65536:
        raise UsageError(
            f"{text!r} is no [LOCAL:]PORT: PORT is the job's, 1 to 65535; LOCAL this machine's "
            "(0: any free port), e.g. `poolctl forward JOB 6006` or `poolctl forward JOB 8000:8888`"
        )
    return numbers


async def run(client: PoolClient, job_id: str, where: str) -> int:
    """Forward until job `job_id` ends (0) or Ctrl-C."""
    local, port = ports(where)
    await _check(client, job_id)

    def listening(bound: int) -> None:
        print(f"forwarding 127.0.0.1:{bound} to port {port} in job {job_id} (Ctrl-C ends it)", flush=True)

    state = await serve(client, job_id, local, port, listening)
    print(f"poolctl: job {job_id} {state}: its forward has ended", file=sys.stderr)
    return 0


async def serve(
    client: PoolClient, job_id: str, local: int, port: int, listening: Callable[[int], None]
) -> str:
    """Relay connections to 127.0.0.1:`local` here (0: any free port; `listening` is told the one
    bound) to `port` in running job `job_id` until the job ends: how it ended. `poolctl jupyter`
    serves its JupyterLab with it."""
    ended = asyncio.ensure_future(_end_of(client, job_id))
    room = asyncio.Semaphore(MAX_OPEN)
    open_: set[asyncio.Task[None]] = set()

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if (owner := peer_uid(writer.get_extra_info("socket"))) not in (os.getuid(), None):
            whose = f"from uid {owner}" if owner >= 0 else "whose owner is not in the socket table (gone?)"
            print(
                f"poolctl: refused a connection {whose}: this forward serves only its own user "
                f"(uid {os.getuid()})",
                file=sys.stderr,
            )
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        open_.add(task)
        try:
            async with room:
                await _relay(client, job_id, port, reader, writer)
        except asyncio.CancelledError:
            # serve()'s end, which cancelled this connection's own task and awaits it: it ends
            # here, as Python 3.11's streams take a handler's task that ends cancelled for an
            # error, and print it (a browser's open connections at Ctrl-C, each a traceback).
            pass
        finally:
            open_.discard(task)
            writer.close()

    try:
        listener = await asyncio.start_server(accepted, "127.0.0.1", local)
    except OSError as exc:
        ended.cancel()
        raise GpupoolError(
            f"cannot listen on 127.0.0.1:{local}: {exc.strerror}; name another local port "
            f"(`poolctl forward {job_id} LOCAL:{port}`, 0 for any free one)",
            ErrorCode.INVALID_ARGUMENT,
        ) from None
    if not sys.platform.startswith("linux"):  # no socket table to tell local users apart by
        print(f"poolctl: no {SOCKETS} here: any local user may connect to this forward", file=sys.stderr)
    try:
        listening(listener.sockets[0].getsockname()[1])
        return await ended
    finally:
        listener.close()
        for task in list(open_):
            task.cancel()
        await asyncio.gather(*open_, return_exceptions=True)
        ended.cancel()


SOCKETS = "/proc/net/tcp"  # the kernel's table of IPv4 TCP sockets: the listener is on 127.0.0.1
# The states of a connection with an owner: established, or half-closed or closing by either end
# (a client that sent its request and shut its side is still its user's); not TIME_WAIT, whose
# rows belong to no one (uid 0) and may be an earlier connection's of the same addresses.
OWNED = frozenset({"01", "04", "05", "07", "08", "09", "0B"})


def peer_uid(sock: socket.socket) -> int | None:
    """The uid owning the other end of `sock`, a connection accepted on 127.0.0.1 (so both ends
    are this machine's): its row in the socket table, the one whose local address is the peer's
    and whose remote address is ours, in a state with an owner. -1 when it is not there (gone
    already); None where there is no such table."""

    def address(host_port: tuple[str, int]) -> str:  # as the table writes it: the native-order word
        host, port = host_port[:2]
        return f"{struct.unpack('=I', socket.inet_aton(host))[0]:08X}:{port:04X}"

    theirs, ours = address(sock.getpeername()), address(sock.getsockname())
    try:
        with open(SOCKETS) as table:
            for line in table:
                row = line.split()
                if row[1:3] == [theirs, ours] and row[3] in OWNED:
                    return int(row[7])
    except OSError:
        return None
    return -1


async def _check(client: PoolClient, job_id: str) -> None:
    """Refuse at once what the server would refuse for every connection: no such job (the
    server's own answer), another user's, one not running, one on an agent's machine."""
    job = (await client.call(ShowJob(job_id), JobDetail)).job
    if job.get("withheld"):  # what the server shows of a job not this user's to act on
        raise NotYours(job_id, job["spec"]["user"], "forward to")
    if job["state"] != "running":
        raise GpupoolError(
            f"job {job_id} is {job['state']}, not running: forward reaches a port inside a running job",
            ErrorCode.CONFLICT,
        )
    if is_agent_worker(job.get("worker") or ""):
        raise GpupoolError(
            f"job {job_id} runs on an agent's machine ({job['worker']}), where forward is not "
            "supported yet; serve the port from the pool's own workers",
            ErrorCode.INVALID_ARGUMENT,
        )


async def _end_of(client: PoolClient, job_id: str) -> str:
    """How job `job_id` ended, once it has."""
    state = "ended"
    async for item in client.stream(WaitJobs([job_id], None)):
        if isinstance(item, JobEnded):
            state = str(item.job.get("state", state))
    return state


async def _relay(
    client: PoolClient, job_id: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """One accepted connection, over its own channel, until either end closes it."""

    async def output(_stream: str, data: bytes) -> None:
        if not data:  # the job's end has shut its side: this one's too, and its input goes on
            if writer.can_write_eof():
                writer.write_eof()
            return
        writer.write(data)
        await writer.drain()

    async def received() -> AsyncIterator[bytes]:
        while data := await reader.read(READ_SIZE):
            yield data

    request = OpenChannel(job_id, "forward", [], stdin=True, port=port)
    try:
        closed = await client.channel(request, output, received())
    except ClientError as exc:  # refused (the job has just ended?), or the connection to the server lost
        print(f"poolctl: a connection to port {port} in {job_id}: {exc}", file=sys.stderr)
        return
    except ConnectionError:  # the local end reset it: its channel is cancelled
        return
    if closed.exit_code is None:  # never connected: say why (nothing listens on the port yet?)
        print(f"poolctl: a connection to port {port} in {job_id}: {closed.reason}", file=sys.stderr)
