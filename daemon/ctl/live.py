"""Live views: `poolctl ls --watch`, `poolctl top`, and `poolctl wait`'s progress.

Each is one request the server streams (WatchPool's views, WaitJobs' jobs as they end), never a
loop of new commands, over one_shot's blocking socket (no event loop to import). On a terminal
rich draws it in place (`top` on the whole screen, as top does); on a pipe each view is printed
after the last, and `wait` prints a line per job as it ends.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from daemon.ctl import render
from daemon.ctl.render import Rows
from protocol import (
    JobDetail,
    JobEnded,
    PoolView,
    Reply,
    Request,
    ShowJob,
    StreamItem,
    Waited,
    WaitJobs,
    WatchEnded,
    WatchPool,
)

if TYPE_CHECKING:
    from rich.console import RenderableType

R = TypeVar("R", bound=Reply)


class Streams(Protocol):
    """What these views ask through (link.Link): one request, each item it streams to `on_item`."""

    def call(
        self, request: Request, reply_type: type[R], on_item: Callable[[StreamItem], None] | None = None
    ) -> R: ...


Section = tuple[str | None, Rows]  # a titled table of a view
RUNNING_COLUMNS = [render.JOB_COLUMNS.index(c) for c in ("id", "name", "user", "queue", "worker", "ran")]


def watch(
    pool: Streams, request: WatchPool, *, top: bool, columns: Sequence[int] | None, as_json: bool
) -> int:
    """Draw each view the server streams for `request` until it ends (or Ctrl-C)."""
    live = None
    if sys.stdout.isatty() and not as_json:
        from rich.live import Live

        live = Live(auto_refresh=False, screen=top, redirect_stdout=False)
        live.start()

    def draw(item: StreamItem) -> None:
        if not isinstance(item, PoolView):
            return
        if (request.user is not None or request.name is not None) and not item.filtered:
            from daemon.ctl.cli import OlderServer  # a server older than the filters lists all

            raise OlderServer.cannot_select()
        if as_json:
            view = {"at": item.at, "jobs": item.jobs} | ({"workers": item.workers} if top else {})
            print(render.json_text(view), flush=True)
            return
        header, sections = top_view(item) if top else ls_view(item, columns)
        if live is not None:
            live.update(_drawn(header, sections), refresh=True)
        else:
            print("\n".join(_plain(header, sections)), end="\n\n", flush=True)

    try:
        pool.call(request, WatchEnded, on_item=draw)
    finally:
        if live is not None:
            live.stop()
    return 0


def ls_view(view: PoolView, columns: Sequence[int] | None) -> tuple[str, list[Section]]:
    return f"{len(view.jobs)} job(s) at {_clock(view.at)}", [(None, render.job_rows(view.jobs, columns))]


def top_view(view: PoolView) -> tuple[str, list[Section]]:
    """The pool at a glance: totals, each queue, each worker, each running job."""
    workers, jobs = view.workers, view.jobs
    healthy = sum(1 for w in workers if w.get("health") == "healthy")
    slots = sum(int(w.get("slots", 0)) for w in workers)
    busy = sum(int(w.get("running", 0)) for w in workers)
    gpus = [g for w in workers for g in w.get("gpus") or []]
    gpus_busy = sum(1 for g in gpus if g.get("job") or g.get("shared"))  # shared: by --gpu-mem jobs
    states = Counter(j["state"] for j in jobs)
    header = (
        f"gpupool at {_clock(view.at)}: {len(workers)} worker(s), {healthy} healthy; "
        f"slots {busy}/{slots} busy; GPUs {gpus_busy}/{len(gpus)} busy; "
        f"{states['queued']} queued, {states['running']} running"
    )
    running = [j for j in jobs if j["state"] == "running"]
    sections: list[Section] = [("QUEUES", _queue_rows(jobs, workers, view.at))]
    sections.append(("WORKERS", render.worker_rows(workers)))
    sections.append(("RUNNING", render.job_rows(running, RUNNING_COLUMNS)))
    return header, sections


def _queue_rows(jobs: Sequence[dict[str, Any]], workers: Sequence[dict[str, Any]], now: float) -> Rows:
    names = sorted({j["spec"]["queue"] for j in jobs} | {q for w in workers for q in w.get("queues") or []})
    rows = []
    for name in names:
        mine = [j for j in jobs if j["spec"]["queue"] == name]
        queued = [j["enqueued_at"] for j in mine if j["state"] == "queued"]
        serving = sum(1 for w in workers if name in (w.get("queues") or []) and w.get("health") == "healthy")
        rows.append(
            [
                name,
                str(len(queued)),
                str(sum(1 for j in mine if j["state"] == "running")),
                render.duration(now - min(queued)) if queued else "-",
                str(serving),
            ]
        )
    return Rows(["QUEUE", "QUEUED", "RUNNING", "OLDEST WAIT", "WORKERS"], rows)


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def _drawn(header: str, sections: list[Section]) -> RenderableType:
    from rich.console import Group
    from rich.text import Text

    parts: list[RenderableType] = [Text(render.clean(header), style="bold")]
    for title, rows in sections:
        parts += [Text(""), render.rich_table(rows, title)]
    return Group(*parts)


def _plain(header: str, sections: list[Section]) -> list[str]:
    lines = [render.clean(header)]
    for title, rows in sections:
        lines += ["", *([title] if title else []), *render.plain_lines(rows)]
    return lines


def wait(pool: Streams, job_ids: list[str], limit: float | None, as_json: bool = False) -> Waited:
    """Wait for `job_ids`, printing each as it ends (`id  state  exit N`), on a terminal with a
    bar of how many have ended, and at the end those that had not (a timeout). Returns the final
    reply (every job as it is at the end). `as_json`: each job's record, a line each, no bar."""
    line = render.json_text if as_json else job_line
    progress = None
    if sys.stdout.isatty() and not as_json and (total := _jobs_in(pool, job_ids)) > 1:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(
            TextColumn("waiting"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True
        )
        task = progress.add_task("", total=total)
        progress.start()

    printed: set[str] = set()

    def ended(item: StreamItem) -> None:
        if not isinstance(item, JobEnded) or item.job["id"] in printed:
            return  # (a wait that went on with another server is told again of those that ended)
        printed.add(item.job["id"])
        if progress is None:
            print(line(item.job), flush=True)
            return
        progress.console.print(line(item.job), markup=False, highlight=False)
        progress.advance(task)

    try:
        reply = pool.call(WaitJobs(job_ids, limit), Waited, on_item=ended)
    finally:
        if progress is not None:
            progress.stop()
    for job in reply.jobs:
        if job["id"] not in printed:
            printed.add(job["id"])
            print(line(job))
    return reply


def _jobs_in(pool: Streams, job_ids: list[str]) -> int:
    """How many jobs `job_ids` stand for, an array's id ("QUEUE@ID") for each of its jobs: what a
    bar counts to. An id the pool does not know counts once (the wait itself says so)."""
    from daemon.errors import GpupoolError

    total = 0
    for job_id in set(job_ids):
        try:
            job = pool.call(ShowJob(job_id), JobDetail).job if "@" in job_id else {}
        except GpupoolError:
            job = {}
        total += int(job["array"]["jobs"]) if "array" in job else 1
    return total


def job_line(job: dict[str, Any]) -> str:
    """A job's id, state and exit code, tab-separated (the server made all three), and why it
    ended where its exit code does not say (timed out, killed by a signal, lost, cancelled)."""
    exit_code = f"\texit {job['exit_code']}" if job["exit_code"] is not None else ""
    detail = job.get("detail") or ""
    why = f"\t{render.clean(detail)}" if detail and not detail.startswith("exited with status") else ""
    return f"{job['id']}\t{job['state']}{exit_code}{why}"
