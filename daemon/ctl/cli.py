"""`poolctl`: the researcher's command line. It parses, calls the server, prints; nothing more.

Exit status: 0 success; 1 a job failed or the request failed; 2 bad usage or input; 3 server
unreachable; 4 authentication refused, or a token file others can read; 5 unknown job; 6 another
user's job (only its owner or a pool admin may act on it) or accounting (`acct --user`); 124
`wait` timed out; 130 Ctrl-C (how `top` and `ls --watch` end, unless given -n); `logs -f` and
`enqueue -f` exit with the job's own exit code, `exec` with its command's, `shell` and `attach`
with the shell's (0 when detached), `forward` 0 when its job ends, `jupyter` too (1 if it failed,
143 on SIGTERM); `health` exits 0 only when the server and its Redis answer.
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
from daemon.ctl import render
from daemon.ctl.commands import MAX_VIEW_JOBS, parser
from daemon.ctl.enqueue_spec import enqueue_request
from daemon.ctl.link import Link, reach
from daemon.ctl.parsing import UsageError
from daemon.errors import GpupoolError, NotYours
from daemon.listing import MORE
from protocol import (
    Accounted,
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
    WatchPool,
    WorkerList,
)

if TYPE_CHECKING:
    from daemon.client.pool_client import PoolClient

R = TypeVar("R", bound=Reply)
Call = Callable[[Request, type[R]], R]  # one request, its reply: one_shot.call, bound to the pool

EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_AUTH, EXIT_NOT_FOUND, EXIT_NOT_YOURS = 1, 2, 3, 4, 5, 6
EXIT_TIMEOUT = 124


# What each error's wire code means for the exit status; any other error is EXIT_FAILED.
EXIT_FOR_CODE: dict[int, int] = {
    ErrorCode.NOT_FOUND: EXIT_NOT_FOUND,
    ErrorCode.INVALID_ARGUMENT: EXIT_USAGE,
    ErrorCode.CONFLICT: EXIT_USAGE,  # an idempotency key reused for another spec
    ErrorCode.PERMISSION_DENIED: EXIT_NOT_YOURS,
}


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


def link(args: argparse.Namespace) -> Link:
    """The pool to talk to, as --server, --pool and --tls-ca say (daemon/ctl/link.py)."""
    return reach(args.server, args.pool, args.tls_ca)


def _run(args: argparse.Namespace) -> int:
    """Most commands are one request and its reply, over a blocking socket (one_shot.py); those
    that stream or move data run on an event loop, with PoolClient. `pilot` asks no server."""
    if args.command == "pilot":
        from daemon.ctl import pilot

        return pilot.run(args)
    request = enqueue_request(args) if args.command == "enqueue" else None  # checked before connecting
    if args.command in ("shell", "attach"):  # refused before connecting when stdin is no terminal
        from daemon.ctl import job_shell

        job_shell.need_terminal(args.command)
        if args.command == "shell":
            request = job_shell.enqueue_request(args)
    if args.command == "jupyter":  # the same: an enqueue of JupyterLab
        from daemon.ctl import job_jupyter

        request = job_jupyter.request(args)
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
    on_loop = (
        args.command == "enqueue"
        and request is not None
        and (
            args.project_dir is not None
            or (isinstance(request, Enqueue) and (_moves_data(args) or args.follow))
        )
    )
    if args.command == "acct":
        from daemon.ctl import acct

        acct.show(to.call(acct.request(args), Accounted), args.by, as_json=args.json, as_csv=args.csv)
        return 0
    if args.command in ("put", "get", "logs", "exec", "forward", "shell", "attach", "jupyter") or on_loop:
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
        case "exec":
            from daemon.ctl import job_exec

            return await job_exec.run(client, args.job, args.argv)
        case "forward":
            from daemon.ctl import job_forward

            return await job_forward.run(client, args.job, args.ports)
        case "shell" | "attach":
            from daemon.ctl import job_shell

            if args.command == "attach":
                return await job_shell.attach(client, args.job)
            assert isinstance(request, Enqueue)
            await _attach_project(client, [request.spec], args.enqueue)
            return await job_shell.shell(client, request)
        case "jupyter":
            from daemon.ctl import job_jupyter

            assert isinstance(request, Enqueue)
            await _attach_project(client, [request.spec], args.enqueue)
            return await job_jupyter.run(client, request, args.port, args.open)
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
    """The project the job runs in (daemon/ctl/project_send.py), recorded in each spec."""
    if args.project_dir is None:
        return
    from daemon.ctl import project_send

    sent = await project_send.send(
        client, args.project_dir, named=bool(args.workdir), required=bool(args.snapshot)
    )
    if sent is None:
        return
    for spec in specs:
        spec["project"] = sent


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
