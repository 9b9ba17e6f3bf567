"""`poolctl jupyter`: a JupyterLab in an interactive job, forwarded here, its URL printed.

The job is queued as `poolctl enqueue` queues one (enqueue_spec.py: the project poolctl runs in,
shipped, and the environment its lock names), and its command is JupyterLab from that
environment, bound to the job's loopback on a port the kernel picks (jobs that share the worker's
network must not collide), which JupyterLab says in its log; poolctl follows the log until it
does, saying now and then why the job still waits, then forwards a local port to it
(job_forward.serve) and prints `http://127.0.0.1:LOCAL/lab?token=...`.

The token is made here and reaches JupyterLab as JUPYTER_TOKEN in the job's environment, never in
its command line: a spec's environment values are shown to its owner and the pool's admins only
(docs/SECURITY.md), and JupyterLab then logs the URL with `token=...` in its place.

A JupyterLab nobody can reach must not hold GPUs: Ctrl-C or SIGTERM at any point after the job is
queued cancels it, and so does any failure of poolctl's own; the job's end ends poolctl jupyter.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import secrets
import signal
import socket
import sys
import time
from collections.abc import AsyncGenerator
from typing import cast

from daemon.client.pool_client import PoolClient
from daemon.client.session import ClientError
from daemon.ctl import job_forward
from daemon.ctl.parsing import UsageError
from daemon.errors import GpupoolError
from daemon.job import is_agent_worker
from protocol import (
    CancelJobs,
    Cancelled,
    Enqueue,
    Enqueued,
    FollowLogs,
    JobDetail,
    LogChunk,
    LogEnd,
    ShowJob,
)

# The job's command: the environment's own Python (`python3`, which an environment and a worker
# without one both have), with the port left to the kernel. The worker picks the job's uid, root
# only where its admin runs jobs as root: JupyterLab is not to refuse to start there.
COMMAND = ("python3", "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", "--port=0", "--allow-root")
LISTENING = re.compile(rb"http://127\.0\.0\.1:(\d+)/lab")  # JupyterLab's "is running at" line
NO_JUPYTERLAB = b"No module named jupyterlab"
LOG_KEPT = 64 * 1024  # of the job's log, searched and quoted when it ends too soon
WHY_FIRST, WHY_EVERY = 1.0, 5.0  # seconds before the first look at a queued job's state, between the next
REMIND_EVERY = 30.0  # a reason unchanged is said again after this long
CANCEL_WITHIN = 10.0  # seconds a cancel on the way out may take (the server may be gone)
EXIT_FAILED, EXIT_TERMINATED = 1, 128 + signal.SIGTERM


class JupyterEnded(GpupoolError):
    """The job ended, or went where it cannot be reached, before JupyterLab could be; exits 1."""


def request(args: argparse.Namespace) -> Enqueue:
    """The job, as `poolctl enqueue` with jupyter's options would queue it, with a new token (that
    command line's namespace kept as `args.enqueue`, for its project to be sent as enqueue's is)."""
    from daemon.ctl.commands import parser
    from daemon.ctl.enqueue_spec import enqueue_request

    if args.port:
        _check_free(args.port)
    token = secrets.token_urlsafe(32)
    as_enqueue = parser().parse_args(["enqueue", "--", *COMMAND])
    vars(as_enqueue).update(
        queue=args.queue, gpus=args.gpus, gpu_mem=args.gpu_mem, timeout=args.time, name=args.name,
        no_env=args.no_env, workdir=args.workdir, env=[f"JUPYTER_TOKEN={token}"],
    )  # fmt: skip
    queued = enqueue_request(as_enqueue)
    assert isinstance(queued, Enqueue)
    args.enqueue = as_enqueue
    return queued


def _check_free(local: int) -> None:
    """Refuse a local port already taken before anything is queued (the forward binds it later)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", local))
        except OSError as exc:
            raise UsageError(
                f"cannot listen on 127.0.0.1:{local}: {exc.strerror}; name another with --port "
                "(0, the default, for any free one)"
            ) from None


async def run(client: PoolClient, queued: Enqueue, local: int, open_browser: bool) -> int:
    """Queue `queued`, serve its JupyterLab on 127.0.0.1:`local` until the job ends (0; 1 if it
    failed), Ctrl-C (130) or SIGTERM (143); the job is cancelled unless it has ended by itself."""
    job_id = (await client.call(queued, Enqueued)).job_id
    print(f"poolctl: {job_id} queued: JupyterLab starts once it runs (Ctrl-C cancels it)", file=sys.stderr)
    main = asyncio.current_task()
    assert main is not None
    terminated = False

    def terminate() -> None:
        """The first SIGTERM ends it as Ctrl-C does (the job cancelled); a second, at once."""
        nonlocal terminated
        if terminated:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
        terminated = True
        main.cancel()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, terminate)
    try:
        state = await _serve(client, job_id, queued.spec["env"]["JUPYTER_TOKEN"], local, open_browser)
    except asyncio.CancelledError:
        main.uncancel()  # taken as the end asked for: the job's cancel below is awaited
        await _cancel(client, job_id)
        if terminated:
            return EXIT_TERMINATED
        raise  # Ctrl-C: asyncio.run makes it KeyboardInterrupt, exit status 130
    except Exception:  # a refusal, the connection lost: nobody reaches this JupyterLab
        await _cancel(client, job_id)
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    print(f"poolctl: job {job_id} {state}: JupyterLab has ended", file=sys.stderr)
    return EXIT_FAILED if state in ("failed", "dead") else 0


async def _serve(client: PoolClient, job_id: str, token: str, local: int, open_browser: bool) -> str:
    """Wait for JupyterLab to listen in job `job_id`, then forward `local` to it until the job
    ends: how it ended."""
    port = await _started(client, job_id)
    job = (await client.call(ShowJob(job_id), JobDetail)).job
    if is_agent_worker(job.get("worker") or ""):
        raise JupyterEnded(
            f"job {job_id} runs on an agent's machine ({job['worker']}), where forward is not supported "
            "yet: it is cancelled; queue it where the pool's own workers serve (--queue)"
        )

    def listening(bound: int) -> None:
        url = f"http://127.0.0.1:{bound}/lab?token={token}"
        print(f"poolctl: JupyterLab in job {job_id} (Ctrl-C ends it and cancels the job):", file=sys.stderr)
        print(url, flush=True)
        if open_browser:
            import webbrowser

            webbrowser.open(url)

    return await job_forward.serve(client, job_id, local, port, listening)


async def _started(client: PoolClient, job_id: str) -> int:
    """JupyterLab's port in job `job_id` once it listens, saying meanwhile why the job waits."""
    port = asyncio.ensure_future(_port(client, job_id))
    said, when, running, wait = "", 0.0, False, WHY_FIRST
    try:
        while not running:
            done, _ = await asyncio.wait([port], timeout=wait)
            if done:
                break
            wait = WHY_EVERY
            job = (await client.call(ShowJob(job_id), JobDetail)).job
            if job["state"] == "queued":
                why = job.get("pending_reason") or "waiting for its turn"
                if why != said or time.monotonic() - when > REMIND_EVERY:
                    print(f"poolctl: {job_id} waits: {why}", file=sys.stderr)
                    said, when = why, time.monotonic()
            elif job["state"] == "running":
                running = True
                where = job.get("worker") or "a worker"
                print(f"poolctl: {job_id} runs on {where}; JupyterLab is starting", file=sys.stderr)
        return await port
    finally:
        port.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await port


async def _port(client: PoolClient, job_id: str) -> int:
    """The port JupyterLab's log says it listens on; JupyterEnded if the job ends first."""
    seen = b""
    # closed on the way out (a generator: its end cancels the request on the server)
    stream = cast("AsyncGenerator[object, None]", client.stream(FollowLogs(job_id, True, "")))
    async with contextlib.aclosing(stream) as items:
        async for item in items:
            if isinstance(item, LogChunk):
                seen = (seen + item.data)[-LOG_KEPT:]
                if found := LISTENING.search(seen):
                    return int(found[1])
            elif isinstance(item, LogEnd):
                raise JupyterEnded(_too_soon(job_id, item.state, seen))
    raise JupyterEnded(_too_soon(job_id, "ended", seen))


def _too_soon(job_id: str, state: str, log: bytes) -> str:
    """Why job `job_id` ended before JupyterLab listened, in a sentence."""
    if NO_JUPYTERLAB in log:
        return (
            f"job {job_id} {state}: its environment has no JupyterLab (python3 -m jupyterlab: No "
            "module named jupyterlab); add `jupyterlab` to the project's lock (e.g. `uv add --dev "
            "jupyterlab`) and run poolctl jupyter again in the project (without --no-env)"
        )
    last = (log.rstrip().splitlines() or [b"(nothing)"])[-1].decode(errors="replace")
    return f"job {job_id} {state} before JupyterLab listened (`poolctl logs {job_id}`); its log ends: {last}"


async def _cancel(client: PoolClient, job_id: str) -> None:
    """Cancel job `job_id` on the way out, saying so; a cancel that cannot be made is said too."""
    try:
        states = (await asyncio.wait_for(client.call(CancelJobs([job_id]), Cancelled), CANCEL_WITHIN)).states
    except (ClientError, TimeoutError) as exc:
        print(f"poolctl: could not cancel job {job_id} ({exc}): `poolctl cancel {job_id}`", file=sys.stderr)
        return
    state = states.get(job_id, "not_found")
    if state in ("cancelled", "cancelling"):
        print(f"poolctl: job {job_id} cancelled: its GPUs are free", file=sys.stderr)
