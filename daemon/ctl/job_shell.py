"""`poolctl shell` and `poolctl attach JOB`: a terminal on a job (docs/PROTOCOL.md §5, kind
"attach").

`shell` queues an interactive job as `poolctl enqueue` would (its spec, its project and locked
environment: enqueue_spec.py), its command a shell by default, on a terminal (`tty`); waits while
it is queued, saying why now and then (Ctrl-C then cancels it); once it runs, attaches. `attach`
attaches to a running shell again, which first replays the end of what it showed.

Attached, the local terminal is in raw mode (restored on every way out): every byte typed goes to
the job's terminal as it is (Ctrl-C and Ctrl-Z reach its foreground program through that
terminal, not through us), its output is written here as it comes, and a change of the window's
size goes with it. `Enter ~ .` (ssh's escape: a `~` first on a line, then `.`) detaches: the
shell lives on, and `poolctl attach JOB` returns to it; `~~` sends one `~`. When the shell exits,
its exit code is poolctl's; when something else ends it (a cancel, its idle or time limit, its
worker's drain), poolctl says what, and exits 128+N for the signal N that stopped it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import termios
import tty
from collections.abc import AsyncIterator

from daemon.client.pool_client import PoolClient
from daemon.client.session import ClientError
from daemon.ctl.parsing import UsageError
from daemon.job import JobState
from protocol import (
    CancelJobs,
    Cancelled,
    ChannelClosed,
    ChannelResize,
    Enqueue,
    Enqueued,
    ErrorCode,
    FollowLogs,
    JobDetail,
    LogChunk,
    OpenChannel,
    ShowJob,
)

# A shell that exists on the worker: bash where there is one, else sh.
DEFAULT_SHELL = ["sh", "-c", "command -v bash >/dev/null 2>&1 && exec bash -l || exec sh -l"]
EXITED = "exited"  # ChannelClosed's reason once the shell has exited (worker/attach.py)
NOT_STARTED = "not started yet"  # a worker's reason for a job still being prepared (execs.py)
ENDED = "not running on its worker any more"  # a worker's reason for a job that has just ended (execs.py)
POLL_SECONDS = 0.5  # how often a queued shell's state is looked at
SAY_SECONDS = 10.0  # how often its reason for waiting is said again, unchanged
START_SECONDS = 600.0  # how long a running job may take to start its shell (its environment built)
END_SECONDS = 30.0  # how long an ended job's outcome may take to reach its server
EXIT_NO_CODE = 1  # the shell never gave one (it never started, or the attach was refused)
EXIT_INTERRUPTED = 130  # Ctrl-C while it was queued: cancelled
READ_SIZE = 4096
# Signals that end poolctl by default: attached, each detaches first (its terminal restored).
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def enqueue_request(args: argparse.Namespace) -> Enqueue:
    """The interactive job the shell's command line asks for, built as `poolctl enqueue` builds
    one (its namespace kept as `args.enqueue`, for its project to be sent as enqueue sends it)."""
    from daemon.ctl.commands import parser
    from daemon.ctl.enqueue_spec import project_start, spec_of

    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    line = ["enqueue", "--queue", args.queue, "--gpus", str(args.gpus)]
    line += ["--gpu-mem", str(args.gpu_mem)] if args.gpu_mem else []
    line += ["--timeout", str(args.time)] if args.time else []
    line += ["--stop-signal", "HUP"]  # a shell is stopped as a hung-up terminal stops it
    line += ["--no-env"] if args.no_env else []
    args.enqueue = parser().parse_args([*line, "--", *(argv or DEFAULT_SHELL)])
    args.enqueue.project_dir = project_start(args.enqueue)
    spec = spec_of(args.enqueue)
    spec["tty"] = True
    if term := os.environ.get("TERM"):  # what the job's programs draw for: this terminal (as ssh passes it)
        spec["env"].setdefault("TERM", term)
    if args.idle:
        spec["idle_limit"] = args.idle
    return Enqueue(spec, None)


async def shell(client: PoolClient, request: Enqueue) -> int:
    """Queue the shell, wait for it to start, attach: its exit code. Until the first attach,
    Ctrl-C cancels it: while it is queued, and while its job prepares its shell's start."""
    job_id = (await client.call(request, Enqueued)).job_id
    print(f"poolctl: {job_id} queued (Ctrl-C cancels it)", file=sys.stderr, flush=True)
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, interrupted.set)
    try:
        state = await _until_running(client, job_id, interrupted)
        if state == "cancelled":
            print(f"poolctl: {job_id} cancelled before its shell started", file=sys.stderr)
            return EXIT_INTERRUPTED
        if state == "running" and (code := await _attach(client, job_id, interrupted)) is not None:
            return code
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    return await _ended_unattached(client, job_id)


async def _ended_unattached(client: PoolClient, job_id: str) -> int:
    """The job ended before any attach (a short command: `shell -- make test`): what it showed,
    from its log (as `poolctl logs`), and its exit code; or, where its program never ran, why."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + END_SECONDS
    while not JobState((job := (await client.call(ShowJob(job_id), JobDetail)).job)["state"]).terminal:
        if loop.time() > deadline:  # (its worker has let it go; the server has not heard yet)
            print(f"poolctl: {job_id} is {job['state']} but its shell has gone", file=sys.stderr)
            return EXIT_NO_CODE
        await asyncio.sleep(POLL_SECONDS)
    if job["exit_code"] is None:
        detail = f": {job['detail']}" if job["detail"] else ""
        print(f"poolctl: {job_id} {job['state']} before its shell started{detail}", file=sys.stderr)
        return EXIT_NO_CODE
    async for item in client.stream(FollowLogs(job_id, False, "")):
        if isinstance(item, LogChunk):
            sys.stdout.buffer.write(item.data)
            sys.stdout.buffer.flush()
    return int(job["exit_code"])


async def _until_running(client: PoolClient, job_id: str, interrupted: asyncio.Event) -> str:
    """Wait while the job is queued, saying why; its state then. Ctrl-C (`interrupted`) cancels it."""
    loop = asyncio.get_running_loop()
    said, said_at = "", 0.0
    while True:
        job = (await client.call(ShowJob(job_id), JobDetail)).job
        if job["state"] != "queued":
            return str(job["state"])
        why = str(job.get("pending_reason") or "waiting for its turn")
        if why != said or loop.time() - said_at >= SAY_SECONDS:
            print(f"poolctl: {job_id} waits: {why}", file=sys.stderr, flush=True)
            said, said_at = why, loop.time()
        if await _interrupted_within(interrupted, POLL_SECONDS):  # cancelled, even if it has just started
            await client.call(CancelJobs([job_id]), Cancelled)
            return "cancelled"


async def _interrupted_within(interrupted: asyncio.Event, seconds: float) -> bool:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await interrupted.wait()
    return interrupted.is_set()


async def attach(client: PoolClient, job_id: str) -> int:
    """Attach this terminal to job `job_id`'s until the shell exits (its exit code) or the user
    detaches (0)."""
    code = await _attach(client, job_id, None)
    assert code is not None
    return code


async def _attach(client: PoolClient, job_id: str, interrupted: asyncio.Event | None) -> int | None:
    """`attach`, or with `interrupted` `shell`'s first: its Ctrl-C then cancels the job until
    the first attach (a Ctrl-C typed into an attach its worker refused counts: it reached no
    shell), and None says the job ended before any attach (`_ended_unattached`)."""
    loop = asyncio.get_running_loop()
    deadline, said = loop.time() + START_SECONDS, False
    while True:
        typed_interrupt = asyncio.Event()
        try:
            closed, detached = await _attached(client, job_id, typed_interrupt)
        except ClientError as exc:
            if interrupted is None:
                raise
            await _first_refused(client, job_id, exc)
            return None
        if detached is not None:
            with contextlib.suppress(OSError):  # (a terminal that hung up takes no more)
                print(f"\r\ndetached: poolctl attach {job_id} to return", file=sys.stderr, flush=True)
            return detached
        if NOT_STARTED in closed.reason and loop.time() < deadline:  # its environment is being built
            if not said:
                print(f"poolctl: {job_id} is starting: {closed.reason}", file=sys.stderr, flush=True)
                said = True
            if await _cancelled_while_starting(client, job_id, interrupted, typed_interrupt):
                return EXIT_INTERRUPTED
            continue
        break
    if closed.reason == EXITED and closed.exit_code is not None:
        return closed.exit_code
    if interrupted is not None and ENDED in closed.reason:
        return None
    print(f"\r\npoolctl: {job_id}: {closed.reason}", file=sys.stderr)  # what ended it, or why not attached
    if closed.reason.startswith("detached"):
        return 0
    return closed.exit_code if closed.exit_code is not None else EXIT_NO_CODE


async def _first_refused(client: PoolClient, job_id: str, refusal: ClientError) -> None:
    """`shell`'s first attach was refused: returns where its job has ended (`_ended_unattached`
    says how); raises the refusal otherwise, having cancelled the job where the refusal is for
    good (it runs where no attach reaches, as an agent's machine: nobody could use it there)."""
    if refusal.code == ErrorCode.CONFLICT:  # (not running: it has ended)
        return
    if refusal.code != ErrorCode.INVALID_ARGUMENT:
        raise refusal
    await client.call(CancelJobs([job_id]), Cancelled)
    raise ClientError(f"{refusal}; poolctl cancelled {job_id}: no attach reaches it there", refusal.code)


async def _cancelled_while_starting(
    client: PoolClient, job_id: str, interrupted: asyncio.Event | None, typed_interrupt: asyncio.Event
) -> bool:
    """Wait a while before attaching again; with `shell`'s `interrupted`, a Ctrl-C (pressed now,
    or typed into the attach just refused) cancels the job instead: True."""
    if interrupted is None:
        await asyncio.sleep(POLL_SECONDS)
        return False
    if typed_interrupt.is_set():
        interrupted.set()
    if not await _interrupted_within(interrupted, POLL_SECONDS):
        return False
    await client.call(CancelJobs([job_id]), Cancelled)
    print(f"poolctl: {job_id} cancelled before its shell started", file=sys.stderr)
    return True


class Escape:
    """ssh's escape in what is typed: `~` first on a line, then `.` detaches, `~` sends one `~`,
    anything else sends both."""

    def __init__(self) -> None:
        self.line_start = True
        self.pending = False  # a `~` first on a line, held

    def feed(self, data: bytes) -> tuple[bytes, bool]:
        """What of `data` to send, and whether to detach (what follows `~.` is dropped)."""
        out = bytearray()
        for byte in data:
            char = bytes((byte,))
            if self.pending:
                self.pending = False
                if char == b".":
                    return bytes(out), True
                out += char if char == b"~" else b"~" + char
            elif self.line_start and char == b"~":
                self.pending = True
                continue
            else:
                out += char
            self.line_start = char in (b"\r", b"\n")
        return bytes(out), False


class _Keyboard:
    """What this terminal sends while attached: what is typed (through the escape), its window's
    sizes, and a detach (`~.`, its end, or a signal that ends poolctl)."""

    def __init__(self, typed_interrupt: asyncio.Event) -> None:
        self.typed: asyncio.Queue[bytes | ChannelResize | None] = asyncio.Queue()
        self.detach = asyncio.Event()
        self.detach_code = 0  # poolctl's exit code once detached
        self.typed_interrupt = typed_interrupt  # set when a Ctrl-C is typed
        self.escape = Escape()

    def readable(self) -> None:
        try:
            data = os.read(0, READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # our terminal has gone
            asyncio.get_running_loop().remove_reader(0)
            self.detach.set()
            return
        if b"\x03" in data:
            self.typed_interrupt.set()
        send, detached = self.escape.feed(data)
        if send:
            self.typed.put_nowait(send)
        if detached:
            self.detach.set()

    def resized(self) -> None:
        if (size := _size()) != (0, 0):  # (an unknown size is left out: the terminal keeps its last)
            self.typed.put_nowait(ChannelResize(*size))

    def signalled(self, sig: signal.Signals) -> None:
        self.detach_code = 128 + sig
        self.detach.set()

    async def sent(self) -> AsyncIterator[bytes | ChannelResize]:
        while (item := await self.typed.get()) is not None:
            yield item


async def _attached(
    client: PoolClient, job_id: str, typed_interrupt: asyncio.Event
) -> tuple[ChannelClosed, int | None]:
    """One attach: the channel's end, and poolctl's exit code if it detached instead (0: the
    user detached; 128+N: signal N ended poolctl, which detaches first, so that the terminal
    is never left raw). `typed_interrupt` is set when a Ctrl-C was typed."""
    loop = asyncio.get_running_loop()
    keyboard = _Keyboard(typed_interrupt)
    rows, cols = _size()
    request = OpenChannel(job_id, "attach", [], stdin=True, rows=rows, cols=cols)
    saved = termios.tcgetattr(0)
    tty.setraw(0)
    try:
        loop.add_reader(0, keyboard.readable)
        loop.add_signal_handler(signal.SIGWINCH, keyboard.resized)
        for sig in ENDING_SIGNALS:
            loop.add_signal_handler(sig, keyboard.signalled, sig)
        channel = asyncio.ensure_future(client.channel(request, _write, keyboard.sent()))
        detaching = asyncio.ensure_future(keyboard.detach.wait())
        await asyncio.wait({channel, detaching}, return_when=asyncio.FIRST_COMPLETED)
        detaching.cancel()
        if not channel.done():  # detached: the channel's cancel tells the server, which detaches
            channel.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await channel
            return ChannelClosed(None, "detached"), keyboard.detach_code
        return channel.result(), None
    finally:
        loop.remove_reader(0)
        for sig in (signal.SIGWINCH, *ENDING_SIGNALS):
            loop.remove_signal_handler(sig)
        with contextlib.suppress(termios.error):  # (a terminal hung up has no mode to restore)
            termios.tcsetattr(0, termios.TCSADRAIN, saved)


async def _write(stream: str, data: bytes) -> None:
    del stream  # a terminal has one output
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def _size() -> tuple[int, int]:
    """This terminal's rows and columns; (0, 0), unknown, where it says 0 for either (as some
    say while they are drawn), which the protocol takes only as both."""
    size = os.get_terminal_size(0)
    return (size.lines, size.columns) if size.lines and size.columns else (0, 0)


def need_terminal(command: str) -> None:
    """Refuse `command` (a UsageError, exit 2) when stdin is not a terminal."""
    if not os.isatty(0):
        raise UsageError(
            f"{command} needs a terminal on its stdin; to run a command without one, "
            "`poolctl enqueue`, or `poolctl exec JOB -- COMMAND` inside a running job"
        )
