"""`poolctl`: the researcher's command line. It parses, calls the server, prints; nothing more.

Exit status: 0 success; 1 a job failed or the request failed; 2 bad usage or input; 3 server
unreachable; 4 authentication refused, or a token file others can read; 5 unknown job; 6 another
user's job (only its owner or a pool admin may act on it); 124 `wait` timed out; `logs -f` exits
with the job's own exit code; `health` exits 0 only when the server and its Redis answer.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from daemon import tokens
from daemon.address import SERVER_PORT
from daemon.ctl import one_shot, render
from daemon.ctl.session import AuthFailed, ClientError, ServerUnreachable, parse_address
from daemon.errors import GpupoolError
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
    ShowJob,
    Waited,
    WaitJobs,
    WorkerList,
)

if TYPE_CHECKING:
    from daemon.ctl.pool_client import PoolClient

R = TypeVar("R", bound=Reply)
Call = Callable[[Request, type[R]], R]  # one request, its reply: one_shot.call, bound to the pool

EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_AUTH, EXIT_NOT_FOUND, EXIT_NOT_YOURS = 1, 2, 3, 4, 5, 6
EXIT_TIMEOUT = 124


class UsageError(GpupoolError):
    """The command line asks for something poolctl cannot do; exits EXIT_USAGE."""

    code = ErrorCode.INVALID_ARGUMENT


# What each error's wire code means for the exit status; any other error is EXIT_FAILED.
EXIT_FOR_CODE: dict[int, int] = {
    ErrorCode.NOT_FOUND: EXIT_NOT_FOUND,
    ErrorCode.INVALID_ARGUMENT: EXIT_USAGE,
    ErrorCode.PERMISSION_DENIED: EXIT_NOT_YOURS,
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="poolctl", description="Queue and follow jobs on a gpupool pool.")
    p.add_argument(
        "--server", metavar="HOST:PORT", help="pool server (default: GPUPOOL_SERVER, or the local pool)"
    )
    p.add_argument(
        "--tls-ca", metavar="FILE", help="CA certificate to verify a TLS server (or GPUPOOL_TLS_CA)"
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_enqueue(sub)

    ls = sub.add_parser("ls", help="list queued and running jobs (like squeue)")
    ls.add_argument("--queue", "-q")
    ls.add_argument("--state", "-s")
    ls.add_argument("--all", "-a", action="store_true", help="include finished jobs")
    ls.add_argument("--limit", type=int, default=1000)
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    ls.add_argument(
        "--format",
        "-o",
        metavar="COLUMNS",
        help=f"the columns to print, in order, e.g. id,state (of: {', '.join(render.JOB_COLUMNS)})",
    )
    ls.add_argument("--no-header", action="store_true", help="the rows alone")

    show = sub.add_parser("show", help="everything known about a job")
    show.add_argument("job")
    show.add_argument("--json", action="store_true")

    logs = sub.add_parser("logs", help="a job's output; -f follows it live and exits with the job's code")
    logs.add_argument("job")
    logs.add_argument("-f", "--follow", action="store_true")

    cancel = sub.add_parser("cancel", help="cancel jobs")
    cancel.add_argument("jobs", nargs="+", metavar="JOB")

    wait = sub.add_parser("wait", help="wait for jobs to end; exit 0 only if all succeeded")
    wait.add_argument("jobs", nargs="+", metavar="JOB")
    wait.add_argument("--timeout", type=float, metavar="SECONDS")

    workers = sub.add_parser("workers", help="the pool's workers")
    workers.add_argument("--json", action="store_true")

    put = sub.add_parser("put", help="upload a file or directory as a dataset (skipped if already stored)")
    put.add_argument("path", metavar="PATH")
    put.add_argument("--name", help="a name to use it by: poolctl enqueue --input NAME")

    get = sub.add_parser("get", help="download a finished job's artifacts and log")
    get.add_argument("job")
    get.add_argument("dest", nargs="?", metavar="DEST", help="directory (default: ./JOB)")

    sub.add_parser("health", help="exit 0 when the server and its Redis answer (for scripts and probes)")
    completion = sub.add_parser(
        "completion", help="shell completion: source <(poolctl completion bash), in ~/.bashrc"
    )
    completion.add_argument("shell", choices=["bash"])
    return p


def _add_enqueue(sub: Any) -> None:  # argparse's _SubParsersAction, which it does not export
    e = sub.add_parser("enqueue", help="queue a job: poolctl enqueue [options] -- CMD [ARG...]")
    e.add_argument("--queue", "-q", default="default")
    e.add_argument("--gpus", type=int, default=0, help="GPUs the job needs")
    e.add_argument(
        "--wait-for-worker",
        action="store_true",
        help="queue a --gpus job even if no worker in the pool has that many GPUs yet",
    )
    e.add_argument("--name", default="")
    e.add_argument(
        "--env", action="append", default=[], metavar="K=V", help="environment variable (repeatable)"
    )
    e.add_argument("--cwd", help="working directory on the worker (default: a fresh scratch directory)")
    e.add_argument(
        "--git",
        nargs="?",
        const="",
        metavar="REPO",
        help="run in a checkout of REPO (default: this checkout's origin, at its exact HEAD commit)",
    )
    e.add_argument("--ref", help="with --git: the branch, tag or commit to run (default: HEAD)")
    e.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME_OR_PATH[:DEST]",
        help="a dataset (a `put` name, or a local file or directory, uploaded first) placed at DEST "
        "in the job's directory (repeatable)",
    )
    e.add_argument(
        "--snapshot",
        action="store_true",
        help="run in a snapshot of this git working tree as it is now, uncommitted changes included",
    )
    e.add_argument("--timeout", type=float, metavar="SECONDS", help="stop the job after this long")
    e.add_argument("--retries", type=int, default=0, help="extra attempts after a non-zero exit")
    e.add_argument(
        "--max-attempts", type=int, default=3, help="attempts lost to dead workers before giving up"
    )
    e.add_argument("--key", metavar="IDEMPOTENCY_KEY", help="same key, same job: safe to retry")
    e.add_argument("--from-file", metavar="JOBS.jsonl", help="queue one job per JSON line (a job spec each)")
    e.add_argument("--json", action="store_true")
    e.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="then follow the job's output and exit with its exit code (Ctrl-C stops following; "
        "the job runs on)",
    )
    e.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]")


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.command == "completion":  # nothing to ask the pool
        from daemon.ctl import completion

        print(completion.bash(p), end="")
        return 0
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


def _address(args: argparse.Namespace) -> str:
    address: str = args.server or tokens.client_server() or f"127.0.0.1:{SERVER_PORT}"
    try:
        parse_address(address)
    except ClientError as exc:
        raise UsageError(str(exc)) from None
    return address


def _run(args: argparse.Namespace) -> int:
    """Most commands are one request and its reply, over a blocking socket (one_shot.py); those
    that stream or move data run on an event loop, with PoolClient."""
    request = _enqueue_request(args) if args.command == "enqueue" else None  # checked before connecting
    if args.command == "put" and not os.path.lexists(args.path):  # the command line's mistake
        raise UsageError(f"{args.path}: no such file or directory")
    address = _address(args)
    tls_ca = args.tls_ca or os.environ.get("GPUPOOL_TLS_CA")
    # auto: TLS beyond loopback; on; off. The same variable sets poold's `tls` option: one meaning.
    tls = os.environ.get("GPUPOOL_TLS", "auto")
    user, token = tokens.local_user(), tokens.client_token()
    on_loop = isinstance(request, Enqueue) and (_moves_data(args) or args.follow)
    if args.command in ("put", "get", "logs") or on_loop:
        import asyncio

        from daemon.ctl.pool_client import PoolClient
        from storage.base import StorageError

        async def on_loop() -> int:
            async with PoolClient(address, user, token, tls_ca=tls_ca, tls=tls) as client:
                return await _on_loop(client, args, request)

        try:
            return asyncio.run(on_loop())
        except StorageError as exc:  # the local store of a single-machine pool failed
            raise ClientError(str(exc)) from None

    def call(request: Request, reply_type: type[R]) -> R:
        return one_shot.call(address, user, token, request, reply_type, tls_ca=tls_ca, tls=tls)

    return _one_request(call, args, request, address)


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
    assert isinstance(request, Enqueue)
    await _attach_data(client, request.spec, args)
    reply = await client.call(request, Enqueued)
    if not args.follow:
        return _enqueued(reply, args.json)
    note = "following its output (Ctrl-C stops following, not the job)"
    print(f"poolctl: {reply.job_id} queued; {note}", file=sys.stderr)
    return await _logs(client, reply.job_id, follow=True)


def _one_request(
    call: Call[Any], args: argparse.Namespace, request: Enqueue | EnqueueBatch | None, address: str
) -> int:
    match args.command:
        case "enqueue" if isinstance(request, EnqueueBatch):
            for job_id in call(request, EnqueuedBatch).job_ids:
                print(render.json_text({"id": job_id}) if args.json else job_id)
        case "enqueue":
            assert request is not None
            return _enqueued(call(request, Enqueued), args.json)
        case "ls":
            try:  # checked before asking
                columns = render.columns(args.format) if args.format else None
            except ValueError as exc:
                raise UsageError(str(exc)) from None
            listing = ListJobs(args.queue, args.state, args.all, args.limit)
            render.jobs(
                call(listing, JobList).jobs, as_json=args.json, columns=columns, header=not args.no_header
            )
        case "show":
            render.job(call(ShowJob(args.job), JobDetail).job, as_json=args.json)
        case "cancel":
            return _cancel(call, args.jobs)
        case "wait":
            return _wait(call, args.jobs, args.timeout)
        case "workers":
            render.workers(call(ListWorkers(), WorkerList).workers, as_json=args.json)
        case "health":
            workers = call(ListWorkers(), WorkerList).workers  # a round trip to Redis too
            healthy = sum(1 for w in workers if w.get("health") == "healthy")
            print(f"ok: server {address} answers, {healthy} healthy worker(s)")
    return 0


def _moves_data(args: argparse.Namespace) -> bool:
    """An enqueue that must pin a commit or upload first (several requests, on a loop)."""
    return args.git is not None or bool(args.input) or args.snapshot


def _enqueued(reply: Enqueued, as_json: bool) -> int:
    print(render.json_text({"id": reply.job_id, "created": reply.created}) if as_json else reply.job_id)
    return 0


def _enqueue_request(args: argparse.Namespace) -> Enqueue | EnqueueBatch:
    if args.from_file:
        if args.input or args.snapshot:
            raise UsageError("--input and --snapshot go with one job, not --from-file")
        if args.follow:
            raise UsageError("--follow goes with one job, not --from-file")
        import orjson

        try:
            lines = Path(args.from_file).read_bytes().splitlines()
            specs = [orjson.loads(line) for line in lines if line.strip()]
        except OSError as exc:
            raise UsageError(f"cannot read jobs from {args.from_file}: {exc.strerror}") from None
        except orjson.JSONDecodeError as exc:
            raise UsageError(f"cannot read jobs from {args.from_file}: {exc}") from None
        if not all(isinstance(s, dict) for s in specs):
            raise UsageError(f"{args.from_file}: each line must be a JSON object (a job spec)")
        return EnqueueBatch(specs)
    return Enqueue(_spec(args), args.key)


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    """The spec the command line describes, less what must be read or uploaded (git, inputs,
    snapshot); refused here if its parts exclude each other (the server validates the whole spec;
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
        "max_attempts": args.max_attempts,
        "cwd": str(Path(args.cwd).resolve()) if args.cwd else None,
    }
    given = {"cwd": args.cwd, "git": args.git is not None, "inputs": args.input, "snapshot": args.snapshot}
    from daemon.job import check_combination  # only enqueue needs the job model

    check_combination({name for name, value in given.items() if value})
    if args.ref and args.git is None:
        raise UsageError("--ref goes with --git")
    return spec


async def _put(client: PoolClient, args: argparse.Namespace) -> int:
    from daemon.ctl import transfer

    ref, sent = await transfer.put(client, Path(args.path), args.name)
    note = "" if sent else "\t(already stored)"
    print(f"{ref.name or ref.sha256}\tsha256:{ref.sha256}\t{ref.size} bytes\t{ref.kind}{note}")
    return 0


async def _get(client: PoolClient, args: argparse.Namespace) -> int:
    from daemon.ctl import transfer

    job = (await client.call(ShowJob(args.job), JobDetail)).job
    from daemon.job import TERMINAL_STATES

    if job["state"] not in TERMINAL_STATES:
        print(f"poolctl: job {args.job} has not finished ({job['state']}): no artifacts yet", file=sys.stderr)
        return EXIT_FAILED
    written = await transfer.get_artifacts(client, job, Path(args.dest or args.job))
    for path, size in written:
        print(f"{path}\t{size}")
    if not written:
        print(f"poolctl: job {args.job} has no artifacts", file=sys.stderr)
    return 0


async def _attach_data(client: PoolClient, spec: dict[str, Any], args: argparse.Namespace) -> None:
    """Pin the commit --git names; upload what --input and --snapshot name; record them in the spec."""
    if args.git is not None:
        from daemon.ctl.checkout import git_source

        spec["git"] = await git_source(args.git, args.ref)
    if not (args.snapshot or args.input):
        return
    from daemon.ctl import transfer  # aiohttp: only for the commands that move data

    try:
        if args.snapshot:
            spec["snapshot"] = await transfer.upload_snapshot(client, Path.cwd())
        if args.input:
            spec["inputs"] = [await transfer.resolve_input(client, text) for text in args.input]
    except transfer.TransferError as exc:
        raise UsageError(str(exc)) from None


async def _logs(client: PoolClient, job_id: str, follow: bool) -> int:
    out = sys.stdout.buffer
    end: LogEnd | None = None
    async for item in client.stream(FollowLogs(job_id, follow, "")):
        if isinstance(item, LogChunk):
            out.write(item.data)
            out.flush()
        elif isinstance(item, LogEnd):
            end = item
    if not follow or end is None:
        return 0
    if end.exit_code is not None:
        return end.exit_code
    return 0 if end.state == "succeeded" else EXIT_FAILED


def _cancel(call: Call[Cancelled], job_ids: list[str]) -> int:
    states = call(CancelJobs(job_ids), Cancelled).states
    status = 0
    for job_id in job_ids:
        state = states.get(job_id, "not_found")
        if state == "not_found":
            print(f"poolctl: no job {job_id!r} in this pool", file=sys.stderr)
            status = EXIT_NOT_FOUND
        elif state == "not_yours":
            owner_only = "only its owner or a pool admin may cancel it"
            print(f"poolctl: job {job_id} is another user's: {owner_only}", file=sys.stderr)
            status = EXIT_NOT_YOURS
        else:
            print(f"{job_id}\t{state}")
    return status


def _wait(call: Call[Waited], job_ids: list[str], limit: float | None) -> int:
    reply = call(WaitJobs(job_ids, limit), Waited)
    for job in reply.jobs:
        print(
            f"{job['id']}\t{job['state']}"
            + (f"\texit {job['exit_code']}" if job["exit_code"] is not None else "")
        )
    if reply.timed_out:
        print(f"poolctl: timed out after {limit:g} s", file=sys.stderr)
        return EXIT_TIMEOUT
    return 0 if all(job["state"] == "succeeded" for job in reply.jobs) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
