"""`poolctl`: the researcher's command line. It parses, calls the server, prints; nothing more.

Exit status: 0 success; 1 a job failed or the request failed; 2 bad usage or input; 3 server
unreachable; 4 authentication refused, or a token file others can read; 5 unknown job; 6 another
user's job (only its owner or a pool admin may act on it); 124 `wait` timed out; 130 Ctrl-C (how
`top` and `ls --watch` end, unless given -n); `logs -f` and `enqueue -f` exit with the job's own
exit code; `health` exits 0 only when the server and its Redis answer.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from daemon import pools, tokens
from daemon.client import session
from daemon.client.session import AuthFailed, ClientError, ServerUnreachable
from daemon.ctl import one_shot, render
from daemon.ctl.enqueue_args import add_enqueue
from daemon.ctl.parsing import Parser, seconds, whole
from daemon.ctl.pilot import add_pilot
from daemon.errors import GpupoolError, NotYours
from daemon.listing import MORE
from daemon.pools import choose
from protocol import (
    CancelJobs,
    Cancelled,
    Enqueue,
    EnqueueBatch,
    Enqueued,
    EnqueuedBatch,
    ErrorCode,
    FollowLogs,
    JobDetail,
    JobList,
    ListJobs,
    ListWorkers,
    LogChunk,
    LogEnd,
    Reply,
    Request,
    Requeued,
    RequeueJobs,
    ShowJob,
    StreamItem,
    WatchPool,
    WorkerList,
)
from protocol.record import Record

if TYPE_CHECKING:
    from daemon.client.pool_client import PoolClient

R = TypeVar("R", bound=Reply)
Call = Callable[[Request, type[R]], R]  # one request, its reply: one_shot.call, bound to the pool

EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_AUTH, EXIT_NOT_FOUND, EXIT_NOT_YOURS = 1, 2, 3, 4, 5, 6
EXIT_TIMEOUT = 124
MAX_VIEW_JOBS = 10_000  # the jobs `top` asks for: all there are, as far as the server lists
MAX_VIEWS = 1_000_000  # -n: days of views at the shortest interval; 0 (until Ctrl-C) for more


class UsageError(GpupoolError):
    """The command line asks for something poolctl cannot do; exits EXIT_USAGE."""

    code = ErrorCode.INVALID_ARGUMENT


# What each error's wire code means for the exit status; any other error is EXIT_FAILED.
EXIT_FOR_CODE: dict[int, int] = {
    ErrorCode.NOT_FOUND: EXIT_NOT_FOUND,
    ErrorCode.INVALID_ARGUMENT: EXIT_USAGE,
    ErrorCode.CONFLICT: EXIT_USAGE,  # an idempotency key reused for another spec
    ErrorCode.PERMISSION_DENIED: EXIT_NOT_YOURS,
}


def _add_selection(command: argparse.ArgumentParser, verb: str) -> None:
    """The options that select jobs by their user and name (`ls`, `cancel`), as Slurm's."""
    whose = command.add_mutually_exclusive_group()
    whose.add_argument("--me", action="store_true", help=f"{verb} only your own jobs (squeue --me)")
    whose.add_argument("--user", "-u", metavar="USER", help=f"{verb} only USER's jobs")
    command.add_argument(
        "--name", metavar="PATTERN", help=f"{verb} only the jobs whose NAME (as ls shows it) matches the glob"
    )


def _add_ls(sub: Any) -> None:  # argparse's _SubParsersAction, which it does not export
    ls = sub.add_parser("ls", help="list queued and running jobs (like squeue)")
    ls.add_argument("--queue", "-q")
    ls.add_argument("--array", metavar="QUEUE@ID", help="only the jobs of this array (--array, --sweep)")
    ls.add_argument("--state", "-s")
    _add_selection(ls, "list")
    ls.add_argument("--all", "-a", action="store_true", help="include finished jobs")
    ls.add_argument("--limit", type=whole(1, MAX_VIEW_JOBS), default=1000, metavar="N")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    ls.add_argument(
        "--format",
        "-o",
        metavar="COLUMNS",
        help=f"the columns to print, in order, e.g. id,state (of: {', '.join(render.JOB_COLUMNS)})",
    )
    ls.add_argument("--no-header", action="store_true", help="the rows alone")
    ls.add_argument(
        "--watch",
        "-w",
        nargs="?",
        type=seconds(),
        const=2.0,
        metavar="SECONDS",
        help="redraw it as it changes, every SECONDS (default 2) until Ctrl-C",
    )
    ls.add_argument(
        "-n", "--views", type=whole(0, MAX_VIEWS), default=0, metavar="N", help="with --watch: stop after N"
    )


def parser() -> Parser:
    p = Parser(prog="poolctl", description="Queue and follow jobs on a gpupool pool.")
    p.add_argument(
        "--server",
        metavar="HOST:PORT",
        help="pool server, or several of one pool, comma-separated (default: GPUPOOL_SERVER, or the "
        "local pool)",
    )
    p.add_argument(
        "--pool", metavar="NAME", help="a pool named in ~/.config/gpupool/pools.toml (or GPUPOOL_POOL)"
    )
    p.add_argument(
        "--tls-ca", metavar="FILE", help="CA certificate to verify a TLS server (or GPUPOOL_TLS_CA)"
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add_enqueue(sub)

    _add_ls(sub)

    show = sub.add_parser("show", help="everything known about a job")
    show.add_argument("job")
    show.add_argument("--json", action="store_true")

    logs = sub.add_parser("logs", help="a job's output; -f follows it live and exits with the job's code")
    logs.add_argument("job")
    logs.add_argument("-f", "--follow", action="store_true")

    cancel = sub.add_parser(
        "cancel",
        help="cancel jobs, by id or by --me, --user, --name and --state (your own unless --user "
        "names another's)",
    )
    cancel.add_argument("jobs", nargs="*", metavar="JOB")
    _add_selection(cancel, "cancel")
    cancel.add_argument("--state", "-s", help="cancel only the jobs in this state")
    cancel.add_argument(
        "--yes", "-y", action="store_true", help="cancel what the filters select without asking"
    )
    cancel.add_argument("--json", action="store_true", help="one JSON object per job")

    requeue = sub.add_parser(
        "requeue",
        help="stop running jobs (SIGTERM, then SIGKILL after the worker's grace) and put them back "
        "at the front of their queues, to run again with attempt + 1",
    )
    requeue.add_argument("jobs", nargs="+", metavar="JOB")
    requeue.add_argument("--json", action="store_true", help="one JSON object per job")

    wait = sub.add_parser("wait", help="wait for jobs to end; exit 0 only if all succeeded")
    wait.add_argument("jobs", nargs="*", metavar="JOB", help="none: nothing to wait for (exit 0)")
    wait.add_argument(
        "--timeout", type=seconds(above=False), metavar="SECONDS", help="stop waiting after this long"
    )
    wait.add_argument("--json", action="store_true", help="each job's record as it ends, a line each")

    top = sub.add_parser("top", help="a live full-screen view of queues, workers and running jobs")
    top.add_argument("-d", "--delay", type=seconds(), default=2.0, metavar="SECONDS", help="between views")
    top.add_argument(
        "-n", "--views", type=whole(0, MAX_VIEWS), default=0, metavar="N", help="stop after N views"
    )
    top.add_argument("--json", action="store_true", help="one JSON object per view")

    sub.add_parser("workers", help="the pool's workers").add_argument("--json", action="store_true")
    add_pilot(sub)

    put = sub.add_parser("put", help="upload a file or directory as a dataset (skipped if already stored)")
    put.add_argument("path", metavar="PATH")
    put.add_argument("--name", help="a name to use it by: poolctl enqueue --input NAME")
    put.add_argument("--json", action="store_true")

    get = sub.add_parser("get", help="download a finished job's artifacts and log")
    get.add_argument("job")
    get.add_argument("dest", nargs="?", metavar="DEST", help="directory (default: ./JOB)")
    get.add_argument("--json", action="store_true", help="one JSON object per file written")

    sub.add_parser("health", help="exit 0 when the server and its Redis answer (for scripts and probes)")
    completion = sub.add_parser(
        "completion",
        help="shell completion: source <(poolctl completion bash) in ~/.bashrc; "
        "source <(poolctl completion zsh) in ~/.zshrc; "
        "poolctl completion fish > ~/.config/fish/completions/poolctl.fish",
    )
    completion.add_argument("shell", nargs="?", choices=["bash", "zsh", "fish"])
    # what the scripts ask on a TAB (job ids, queue names), one a line; silent when it fails
    completion.add_argument(
        "--words", choices=["jobs", "cancellable", "queues", "pools"], help=argparse.SUPPRESS
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_all(argv)
    if args.command == "completion":  # a script, or the words a script asks for (never an error)
        from daemon.ctl import completion

        return completion.main(p, args)
    try:
        return _run(args)
    except ServerUnreachable as exc:
        print(f"poolctl: {render.clean(exc)}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (AuthFailed, tokens.TokenError) as exc:  # refused, or no token poolctl may use
        print(f"poolctl: {render.clean(exc)}", file=sys.stderr)
        return EXIT_AUTH
    except GpupoolError as exc:  # usage, the server's refusal, git, a transfer: the sentence says
        print(f"poolctl: {render.clean(exc)}", file=sys.stderr)
        return EXIT_FOR_CODE.get(exc.code, EXIT_FAILED)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `poolctl logs JOB | head`
        sys.stderr.close()
        return 0


class Link(Record):
    """How poolctl reaches its pool: where, as whom, and how it trusts the server."""

    server: str
    user: str
    token: str | None
    tls_ca: str | None
    tls: str  # auto: TLS beyond loopback; on; off (GPUPOOL_TLS means the same as poold's `tls`)
    tls_pin: str | None
    name: str | None = None  # the pool's, in pools.toml, when it was chosen by one

    def call(
        self, request: Request, reply_type: type[R], on_item: Callable[[StreamItem], None] | None = None
    ) -> R:
        """One request and its reply, over a blocking socket (one_shot.py); streamed items to `on_item`."""
        return one_shot.call(
            self.server, self.user, self.token, request, reply_type,
            tls_ca=self.tls_ca, tls=self.tls, tls_pin=self.tls_pin, on_item=on_item,
        )  # fmt: skip

    def client(self) -> PoolClient:
        """A connection for an event loop: streams and transfers."""
        from daemon.client.pool_client import PoolClient

        return PoolClient(
            self.server, self.user, self.token, tls_ca=self.tls_ca, tls=self.tls, tls_pin=self.tls_pin
        )


def link(args: argparse.Namespace) -> Link:
    """The pool to talk to (daemon/pools.py says which of --server, --pool, GPUPOOL_SERVER,
    GPUPOOL_POOL, pools.toml), its addresses checked (one server, or several of the pool,
    comma-separated), and its user and token."""
    pool = choose(args.server, args.pool)
    if pool.note is not None:  # another pool could be meant: say which this is
        print(f"poolctl: {pool.note}", file=sys.stderr)
    try:
        session.addresses(pool.server)
    except ClientError as exc:
        raise UsageError(f"{exc} (pool {pool.name})" if pool.name else str(exc)) from None
    return Link(
        server=pool.server,
        name=pool.name,
        user=tokens.local_user(pool_user=pool.user),
        token=tokens.client_token(token_file=pool.token_file),
        tls_ca=args.tls_ca or os.environ.get("GPUPOOL_TLS_CA") or pool.tls_ca,
        tls=os.environ.get("GPUPOOL_TLS") or pool.tls or "auto",
        tls_pin=pool.tls_pin,
    )


def _run(args: argparse.Namespace) -> int:
    """Most commands are one request and its reply, over a blocking socket (one_shot.py); those
    that stream or move data run on an event loop, with PoolClient. `pilot` asks no server."""
    if args.command == "pilot":
        from daemon.ctl import pilot

        return pilot.run(args)
    request = _enqueue_request(args) if args.command == "enqueue" else None  # checked before connecting
    if args.command == "put" and not os.path.lexists(args.path):  # the command line's mistake
        raise UsageError(f"{args.path}: no such file or directory")
    if args.command == "cancel":
        _check_cancel(args)
    if args.command == "wait" and not args.jobs:  # `poolctl wait $(poolctl ls --format id --no-header)`
        print("poolctl: nothing to wait for", file=sys.stderr)
        return 0
    to = link(args)
    try:
        return _talk(to, args, request)
    except ServerUnreachable:  # a single-machine pool's entry, left when it stopped?
        if to.name is not None and (stale := pools.not_running(to.name, to.server)) is not None:
            raise ServerUnreachable(stale) from None
        raise


def _talk(to: Link, args: argparse.Namespace, request: Enqueue | EnqueueBatch | None) -> int:
    """The command's requests to the pool at `to`."""
    on_loop = request is not None and (
        args.project_dir is not None or (isinstance(request, Enqueue) and (_moves_data(args) or args.follow))
    )
    if args.command in ("put", "get", "logs") or on_loop:
        import asyncio

        from storage.base import StorageError

        async def on_loop() -> int:
            async with to.client() as client:
                return await _on_loop(client, args, request)

        try:
            return asyncio.run(on_loop())
        except StorageError as exc:  # the local store of a single-machine pool failed
            raise ClientError(str(exc)) from None

    return _one_request(to, args, request)


async def _on_loop(
    client: PoolClient, args: argparse.Namespace, request: Enqueue | EnqueueBatch | None
) -> int:
    match args.command:
        case "put":
            return await _put(client, args)
        case "get":
            return await _get(client, args)
        case "logs":
            return await _logs(client, args.job, args.follow)
    if isinstance(request, EnqueueBatch):  # an array, run in its project
        await _attach_project(client, request.specs, args)
        try:
            ids = (await client.call(request, EnqueuedBatch)).job_ids
        except ClientError as exc:
            _maybe_partly_queued(exc, args)
            raise
        _batch_enqueued(ids, args)
        return 0
    assert isinstance(request, Enqueue)
    await _attach_project(client, [request.spec], args)
    await _attach_data(client, request.spec, args)
    reply = await client.call(request, Enqueued)
    if not args.follow:
        return _enqueued(reply, args.json)
    note = "following its output (Ctrl-C stops following, not the job)"
    print(f"poolctl: {reply.job_id} queued; {note}", file=sys.stderr)
    return await _logs(client, reply.job_id, follow=True)


def _one_request(to: Link, args: argparse.Namespace, request: Enqueue | EnqueueBatch | None) -> int:
    call = to.call
    match args.command:
        case "enqueue" if isinstance(request, EnqueueBatch):
            try:
                ids = call(request, EnqueuedBatch).job_ids
            except ClientError as exc:
                _maybe_partly_queued(exc, args)
                raise
            _batch_enqueued(ids, args)
        case "enqueue":
            assert request is not None
            return _enqueued(call(request, Enqueued), args.json)
        case "ls" | "top" if args.command == "top" or args.watch is not None:
            return _watch(to, args)
        case "wait":
            return _wait(to, args.jobs, args.timeout, args.json)
        case "ls":
            _ls(to, args)
        case "show":
            render.job(call(ShowJob(args.job), JobDetail).job, as_json=args.json)
        case "cancel":
            return _cancel(to, args)
        case "requeue":
            states = call(RequeueJobs(args.jobs), Requeued).states
            return _states(states, args.jobs, args.json, "requeue")
        case "workers":
            render.workers(call(ListWorkers(), WorkerList).workers, as_json=args.json)
        case "health":
            workers = call(ListWorkers(), WorkerList).workers  # a round trip to Redis too
            healthy = sum(1 for w in workers if w.get("health") == "healthy")
            print(f"ok: server {to.server} answers, {healthy} healthy worker(s)")
    return 0


def _moves_data(args: argparse.Namespace) -> bool:
    """An enqueue that must pin a commit or upload first (several requests, on a loop)."""
    return args.git is not None or bool(args.input)


def _project_start(args: argparse.Namespace) -> Path | None:
    """Where to look for the job's project (daemon/ctl/project.py), or None for none: `--workdir
    DIR`, else here (a cheap look for a project first: outside one, nothing is asked of git), unless
    the job runs elsewhere (--workdir none, --cwd, --git, --from-file)."""
    from daemon.ctl.project_root import maybe_within, real

    if args.workdir == "none":
        if args.snapshot:
            raise UsageError("--snapshot runs the job in its project; --workdir none in a scratch directory")
        return None
    if args.from_file:
        if args.workdir or args.snapshot:
            raise UsageError("--workdir and --snapshot go with one command, not --from-file")
        return None
    if args.workdir:
        if not os.path.isdir(args.workdir):
            raise UsageError(f"--workdir {args.workdir}: no such directory")
        return real(Path(args.workdir))
    here = real(Path.cwd())
    if args.cwd or args.git is not None:
        return here if args.snapshot else None  # --snapshot with them: refused by _spec
    if args.snapshot or maybe_within(here, real(Path.home())):
        return here
    return None


def _cancel(to: Link, args: argparse.Namespace) -> int:
    """Cancel the jobs named, or those the options select (daemon/ctl/selection.py)."""
    if args.jobs:
        states = to.call(CancelJobs(args.jobs), Cancelled).states
        return _states(states, args.jobs, args.json, "cancel")
    from daemon.ctl import selection

    picked = _listed(to, selection.request(args, to.user))
    return selection.cancel(picked, selection.described(args, to.user), args, lambda r: to.call(r, Cancelled))


def _check_cancel(args: argparse.Namespace) -> None:
    """`cancel` takes job ids, or options that select jobs (daemon/ctl/selection.py), not both."""
    selects = args.me or args.user or args.name or args.state
    if args.jobs and selects:
        raise UsageError("cancel takes job ids, or --me, --user, --name and --state, not both")
    if not args.jobs and not selects:
        raise UsageError(
            "cancel what? give job ids, or select jobs with --me, --user, --name or --state "
            "(e.g. poolctl cancel --me --state queued)"
        )


def _whose(to: Link, args: argparse.Namespace) -> str | None:
    """The user whose jobs --me or --user selects (None: anyone's)."""
    return to.user if args.me else args.user


class OlderServer(GpupoolError):
    """The pool's server predates what the command asks of it; exits EXIT_FAILED."""

    code = ErrorCode.UNKNOWN_OP

    @classmethod
    def cannot_select(cls) -> OlderServer:
        return cls(
            "this pool's server is older than --me, --user and --name and cannot select jobs by "
            "user or name: ask its admin to upgrade poold (meanwhile `poolctl ls --json` lists all)"
        )


def _listed(to: Link, request: ListJobs) -> list[dict[str, Any]]:
    """The jobs `request` selects; refused where the server ignored its user and name (one older
    than they are lists everyone's)."""
    reply = to.call(request, JobList)
    if (request.user is not None or request.name is not None) and not reply.filtered:
        raise OlderServer.cannot_select()
    return reply.jobs


def _ls(to: Link, args: argparse.Namespace) -> None:
    q = args.array.partition("@")[0] if args.array else args.queue
    columns = _columns(args)
    request = ListJobs(q, args.state, args.all, args.limit, _whose(to, args), args.name, _reasons(columns))
    jobs = _listed(to, request)
    render.jobs(
        [j for j in jobs if not args.array or j["spec"].get("array") == args.array],
        as_json=args.json,
        columns=columns,
        header=not args.no_header,
    )
    if jobs and (more := jobs[-1].get(MORE)):  # (daemon/listing.py)
        print(
            f"poolctl: {more} more not shown (a listing's reply is bounded in size); narrow it "
            "with --me, --name, --queue, --state or --limit",
            file=sys.stderr,
        )


def _enqueued(reply: Enqueued, as_json: bool) -> int:
    print(render.json_text({"id": reply.job_id, "created": reply.created}) if as_json else reply.job_id)
    return 0


def _batch_enqueued(ids: list[str], args: argparse.Namespace) -> None:
    """A batch's ids, one a line; an array's (--array, --sweep) id alone, which stands for them."""
    if array_id := getattr(args, "array_id", None):
        print(render.json_text({"array": array_id, "jobs": ids}) if args.json else array_id)
        print(f"poolctl: {len(ids)} jobs queued as array {array_id}", file=sys.stderr)
        return
    for job_id in ids:
        print(render.json_text({"id": job_id}) if args.json else job_id)


def _maybe_partly_queued(exc: ClientError, args: argparse.Namespace) -> None:
    """An array's batch that failed once it had left (the server went away, or its Redis did) may
    have queued some of its jobs: say the array's id, by which they are found and cancelled."""
    array_id = getattr(args, "array_id", None)
    if array_id and (exc.sent or exc.code == ErrorCode.UNAVAILABLE):
        from daemon.ctl.arrays import partly_queued

        print(f"poolctl: {partly_queued(array_id)}", file=sys.stderr)


def _enqueue_request(args: argparse.Namespace) -> Enqueue | EnqueueBatch:
    args.project_dir = _project_start(args)
    if args.array or args.sweep:
        if args.from_file or args.input or args.follow or args.key:
            raise UsageError(
                "--array and --sweep go with one command, not --from-file, --input, --follow or --key"
            )
        from daemon.ctl.arrays import ArrayError, array_specs, parse_array, parse_sweep

        try:
            indices, limit = parse_array(args.array) if args.array else (None, 0)
            args.array_id, specs = array_specs(_spec(args), indices, parse_sweep(args.sweep), limit)
        except ArrayError as exc:
            raise UsageError(str(exc)) from None
        return EnqueueBatch(specs)
    if args.from_file:
        if args.input:
            raise UsageError("--input goes with one job, not --from-file")
        if args.follow:
            raise UsageError("--follow goes with one job, not --from-file")
        from daemon.ctl.jobs_file import read_jobs

        return EnqueueBatch(read_jobs(args.from_file))
    return Enqueue(_spec(args), args.key)


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    """The spec the command line describes, less what must be read or uploaded (git, inputs, the
    project); refused here if its parts exclude each other (the server validates the whole spec;
    this spares an upload that would be refused)."""
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise UsageError("nothing to run: give the command after --, e.g. poolctl enqueue -- python train.py")
    env = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--env {item!r}: expected NAME=VALUE")
        env[name] = value
    spec: dict[str, Any] = {
        "argv": argv,
        "queue": args.queue,
        "name": args.name,
        "env": env,
        "gpus": args.gpus,
        "wait_for_worker": args.wait_for_worker,
        "timeout": args.timeout,
        "retries": args.retries,
        "priority": args.priority,
        "checkpoint_every": args.checkpoint_every,
        "stop_signal": args.stop_signal,
        "stop_grace": args.stop_grace,
        "max_attempts": args.max_attempts,
        "cwd": str(Path(args.cwd).resolve()) if args.cwd else None,
    }
    if args.gpu_mem:  # sent only when asked for: a server that does not know it refuses the field
        spec["gpu_mem"] = args.gpu_mem
    if args.notify:  # the same; checked here too, before any upload
        spec["notify"] = _notify_url(args.notify)
    if args.no_env:  # the same
        spec["env_from_lock"] = False
    if args.after:
        spec["after"] = args.after
    given = {
        "cwd": args.cwd,
        "git": args.git is not None,
        "inputs": args.input,
        "project": getattr(args, "project_dir", None) is not None,  # (_enqueue_request sets it)
    }
    from daemon.exclusive import check_combination, check_gpu_request  # only enqueue asks

    check_combination({name for name, value in given.items() if value})
    check_gpu_request(args.gpus, args.gpu_mem)
    if args.ref and args.git is None:
        raise UsageError("--ref goes with --git")
    return spec


def _notify_url(url: str) -> str:
    from daemon.webhook import check_url  # only enqueue asks

    try:
        return check_url(url)
    except ValueError as exc:
        raise UsageError(f"--notify {url!r}: {exc}") from None


async def _put(client: PoolClient, args: argparse.Namespace) -> int:
    from daemon.ctl import transfer

    ref, sent = await transfer.put(client, Path(args.path), args.name)
    note = "" if sent else "\t(already stored)"
    if args.json:
        print(
            render.json_text(
                {"name": ref.name, "sha256": ref.sha256, "size": ref.size, "kind": ref.kind, "sent": sent}
            )
        )
        return 0
    print(f"{ref.name or ref.sha256}\tsha256:{ref.sha256}\t{ref.size} bytes\t{ref.kind}{note}")
    return 0


async def _get(client: PoolClient, args: argparse.Namespace) -> int:
    from daemon.ctl import transfer

    job = (await client.call(ShowJob(args.job), JobDetail)).job
    from daemon.job import TERMINAL_STATES

    if "array" in job:  # an array's id: each of its jobs into DEST/JOB
        status = 0
        for job_id in job["array"]["ids"]:
            one = argparse.Namespace(
                **{**vars(args), "job": job_id, "dest": str(Path(args.dest or args.job) / job_id)}
            )
            status = max(status, await _get(client, one))
        return status

    if job.get("withheld"):  # the server keeps its result from this user: another user's job
        raise NotYours(job["id"], job["spec"]["user"], "download the artifacts of")
    if job["state"] not in TERMINAL_STATES:
        print(f"poolctl: job {args.job} has not finished ({job['state']}): no artifacts yet", file=sys.stderr)
        return EXIT_FAILED
    written = await transfer.get_artifacts(client, job, Path(args.dest or args.job))
    for path, size in written:
        print(render.json_text({"path": str(path), "size": size}) if args.json else f"{path}\t{size}")
    if not written:
        print(f"poolctl: job {args.job} has no artifacts", file=sys.stderr)
    return 0


async def _attach_project(client: PoolClient, specs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The project the job runs in (daemon/ctl/project.py), its packs uploaded where the pool
    lacks them, recorded in each spec."""
    if args.project_dir is None:
        return
    import asyncio  # loaded already: this runs on its loop

    from daemon.ctl import project, project_packs
    from daemon.ctl.pack_cache import PackCache, cache_dir
    from daemon.ctl.project_root import MARKERS, real
    from daemon.ctl.transfer import TransferError
    from daemon.git import GitError

    try:
        home = real(Path.home())
        found = await (project.named if args.workdir else project.find)(args.project_dir, home)
    except GitError as exc:
        raise UsageError(f"cannot list the project's files: {exc}") from None
    if found is None:
        if args.snapshot:
            raise UsageError(
                "--snapshot needs a project here: a git working tree, or a directory holding "
                f"{', '.join(MARKERS)}"
            )
        return
    project.check_size(found, project.max_bytes())
    pyproject = await asyncio.to_thread(project.needs_lock, found)
    lock = pyproject and await asyncio.to_thread(project.lock_for, pyproject, cache_dir())
    if lock:
        found = project.with_lock(found, lock)
    try:
        sent = await project_packs.upload(client, found, PackCache(found.root))
    except TransferError as exc:
        raise UsageError(str(exc)) from None
    except ClientError as exc:  # the pool's store, mostly: the way round it is said
        if isinstance(exc, ServerUnreachable | AuthFailed):
            raise
        hint = f"{exc.message}; the job was not queued (--workdir none runs it without {found.root})"
        raise ClientError(hint, exc.code) from None
    for spec in specs:
        spec["project"] = sent.spec


async def _attach_data(client: PoolClient, spec: dict[str, Any], args: argparse.Namespace) -> None:
    """Pin the commit --git names; upload what --input names; record them in the spec."""
    if args.git is not None:
        from daemon.ctl.checkout import git_source

        spec["git"] = await git_source(args.git, args.ref)
    if not args.input:
        return
    from daemon.ctl import transfer  # aiohttp: only for the commands that move data

    try:
        spec["inputs"] = [await transfer.resolve_input(client, text) for text in args.input]
    except transfer.TransferError as exc:
        raise UsageError(str(exc)) from None


async def _logs(client: PoolClient, job_id: str, follow: bool) -> int:
    """Print the job's log (following it with `follow`); a server that goes away meanwhile is
    left for another of the pool's, from the byte after the last one printed."""
    import asyncio  # loaded already: this runs on its loop

    out = sys.stdout.buffer
    end: LogEnd | None = None
    offset = ""
    moves = 0  # since the last output: every server taken in turn without any is the end
    while True:
        try:
            async for item in client.stream(FollowLogs(job_id, follow, offset)):
                if isinstance(item, LogChunk):
                    out.write(item.data)
                    out.flush()
                    offset, moves = item.offset, 0
                elif isinstance(item, LogEnd):
                    end = item
            break
        except ClientError as exc:
            moves += 1
            if not session.gone(exc) or moves > len(client.targets) or not await client.move_on(exc):
                raise
            await asyncio.sleep(0.2 * moves)  # a server in a crash loop is not asked at full speed
    if not follow or end is None:
        return 0
    if end.exit_code is not None:
        return end.exit_code
    return 0 if end.state == "succeeded" else EXIT_FAILED


def _states(states: dict[str, str], job_ids: list[str], as_json: bool, action: str) -> int:
    """A cancel's or a requeue's answer, a line per job (an array's id answered for each of its
    jobs); the exit code says the worst."""
    status = 0
    for job_id in [*states, *(j for j in job_ids if j not in states and "@" not in j)]:
        state = states.get(job_id, "not_found")
        if state == "not_found":
            print(f"poolctl: no job {job_id!r} in this pool", file=sys.stderr)
            status = EXIT_NOT_FOUND
        elif state == "not_yours":
            owner_only = f"only its owner or a pool admin may {action} it"
            print(f"poolctl: job {job_id} is another user's: {owner_only}", file=sys.stderr)
            status = EXIT_NOT_YOURS
        else:
            print(render.json_text({"id": job_id, "state": state}) if as_json else f"{job_id}\t{state}")
            if action == "requeue" and state not in ("requeueing", "cancelling", "queued"):
                print(
                    f"poolctl: job {job_id} has ended ({state}): requeue puts back only a running job; "
                    "to run it again, enqueue it anew",
                    file=sys.stderr,
                )
                status = status or EXIT_FAILED
    return status


def _wait(to: Link, job_ids: list[str], limit: float | None, as_json: bool) -> int:
    from daemon.ctl import live

    reply = live.wait(to, job_ids, limit, as_json)  # prints each job as it ends, then those that did not
    if reply.timed_out:
        print(f"poolctl: timed out after {limit:g} s", file=sys.stderr)
        return EXIT_TIMEOUT
    return 0 if all(job["state"] == "succeeded" for job in reply.jobs) else EXIT_FAILED


def _columns(args: argparse.Namespace) -> list[int] | None:
    try:
        return render.columns(args.format) if args.format else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _reasons(columns: list[int] | None) -> bool:
    """Whether the columns show why each queued job waits, which the server works out on request."""
    return columns is not None and render.JOB_COLUMNS.index("reason") in columns


def _watch(to: Link, args: argparse.Namespace) -> int:
    """`ls --watch` and `top`: one streamed request, drawn as each view arrives."""
    from daemon.ctl import live

    top = args.command == "top"
    interval = args.delay if top else args.watch  # above 0, and -n at least 0: their types say
    if top:
        request = WatchPool(None, None, False, MAX_VIEW_JOBS, interval, args.views)
        return live.watch(to, request, top=True, columns=None, as_json=args.json)
    columns = _columns(args)
    request = WatchPool(
        args.queue, args.state, args.all, args.limit, interval, args.views, _whose(to, args), args.name,
        _reasons(columns),
    )  # fmt: skip
    return live.watch(to, request, top=False, columns=columns, as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())
