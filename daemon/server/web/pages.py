"""The dashboard's pages: what each shows, read through the server's `Handlers` as the signed-in
user (so a page shows and does only what poolctl would for that user).

Each page is a function from the request to a template and its context; its `live` block is
what the page's event stream (live.py) renders again every few seconds. Reads of the whole pool
come from the shared snapshot (snapshot.py), a job's own page from the job's record as it is now.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from aiohttp import web
from aiohttp.helpers import content_disposition_header
from redis.exceptions import RedisError

from daemon.errors import GpupoolError
from daemon.job import JobState
from daemon.queue.overview import JobRow
from daemon.server.handlers import Handlers
from daemon.server.web import charts
from daemon.server.web.guard import signed_in
from daemon.server.web.snapshot import Snapshot, Snapshots
from protocol import CancelJobs, DownloadTicket, ErrorCode, JobDetail, PrepareDownload, ShowJob, StreamItem
from storage.local import LocalStore

HANDLERS = web.AppKey("handlers", Handlers)
SNAPSHOTS = web.AppKey("snapshots", Snapshots)
PAGE_SIZE = 50
REDIS_DOWN = "the pool's Redis is unreachable right now; retry in a moment"
SORTS = {  # ?sort= -> a row's key; missing times sort first
    "id": lambda r: r.id,
    "user": lambda r: r.user,
    "queue": lambda r: r.queue,
    "state": lambda r: r.state,
    "name": lambda r: r.name or r.command,
    "enqueued": lambda r: r.enqueued_at,
    "started": lambda r: r.started_at or 0.0,
    "ended": lambda r: r.ended_at or 0.0,
}
STATUS: dict[int, int] = {
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.RESOURCE_EXHAUSTED: 503,
}
Page = tuple[str, dict[str, Any]]
PageFunction = Callable[[web.Request], Awaitable[Page]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class PageError(Exception):
    """A request the page cannot serve: its HTTP status and the sentence to show."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def refusal(exc: PageError) -> web.HTTPException:
    """`exc` as a plain-text HTTP error (for requests a script makes, not a page)."""
    return _HTTP.get(exc.status, web.HTTPInternalServerError)(text=exc.message + "\n")


_HTTP: dict[int, type[web.HTTPException]] = {
    400: web.HTTPBadRequest,
    403: web.HTTPForbidden,
    404: web.HTTPNotFound,
    503: web.HTTPServiceUnavailable,
}


async def ask(
    request: web.Request, message: Any, send: Callable[[StreamItem], Awaitable[None]] | None = None
) -> Any:
    """`message` answered by the server's handlers as the signed-in user; their refusals become
    PageErrors with the sentence poolctl would print."""

    async def ignore(item: StreamItem) -> None:
        pass

    try:
        return await request.app[HANDLERS].handle(message, signed_in(request).user, send or ignore)
    except GpupoolError as exc:
        raise PageError(STATUS.get(ErrorCode.coerce(exc.code), 500), exc.message) from None


async def _snapshot(request: web.Request) -> Snapshot:
    """The pool as all viewers share it; Redis's failure as the sentence poolctl would print."""
    try:
        return await request.app[SNAPSHOTS].get()
    except RedisError:
        raise PageError(503, REDIS_DOWN) from None


def may_act(request: web.Request, owner: str) -> bool:
    user = signed_in(request).user
    return owner == user or user in request.app[HANDLERS].admins


# -- the pool at a glance ---------------------------------------------------------------------------


async def pool(request: web.Request) -> Page:
    snap = await _snapshot(request)
    now = time.time()
    by_queue: dict[str, list[JobRow]] = {q: [] for q in snap.queues}
    for row in snap.rows:
        by_queue.setdefault(row.queue, []).append(row)
    queues = []
    for name, rows in sorted(by_queue.items()):
        queued = [r.enqueued_at for r in rows if r.state == JobState.QUEUED]
        waits = [r.started_at - r.enqueued_at for r in rows if r.started_at and now - r.started_at < 3600]
        queues.append(
            {
                "name": name,
                "waiting": snap.depths.get(name, len(queued)),
                "running": sum(r.state == JobState.RUNNING for r in rows),
                "oldest": now - min(queued) if queued else None,
                "median_wait": statistics.median(waits) if waits else None,
            }
        )
    states = Counter(r.state for r in snap.rows)
    return "pool.html", {
        "queues": queues,
        "workers": [_worker_view(w, snap.history) for w in snap.workers],
        "states": [(s.value, states.get(s.value, 0)) for s in JobState],
        "total": len(snap.rows),
    }


def _worker_view(worker: dict[str, Any], history: dict[str, list[Any]]) -> dict[str, Any]:
    gpus = []
    for gpu in worker.get("gpus") or ():
        readings = history.get(str(gpu.get("uuid")), [])
        used, total = gpu.get("memory_used"), gpu.get("memory_total") or gpu.get("memory")
        gpus.append(
            gpu
            | {
                "util_points": charts.utilization_points(readings),
                "mem_points": charts.memory_points(readings),
                "util_bar": charts.bar(gpu.get("utilization")),
                "mem_bar": charts.bar(used / total if used is not None and total else None),
                "mem_total": total,
            }
        )
    return worker | {"gpus": gpus}


# -- the job list -----------------------------------------------------------------------------------


async def jobs(request: web.Request) -> Page:
    q = request.query
    user, queue, state = q.get("user", ""), q.get("queue", ""), q.get("state", "")
    sort = q.get("sort", "enqueued") if q.get("sort") in SORTS else "enqueued"
    descending = q.get("order", "desc") != "asc"
    try:
        page = max(1, int(q.get("page", "1")))
    except ValueError:
        raise PageError(400, f"page {q.get('page')!r} is not a number") from None
    if state and state not in set(JobState):
        raise PageError(400, f"unknown state {state!r}; one of {', '.join(JobState)}")
    snap = await _snapshot(request)
    rows = [
        r
        for r in snap.rows
        if (not user or r.user == user)
        and (not queue or r.queue == queue)
        and (not state or r.state == state)
    ]
    rows.sort(key=SORTS[sort], reverse=descending)
    pages = max(1, -(-len(rows) // PAGE_SIZE))
    page = min(page, pages)
    shown = rows[(page - 1) * PAGE_SIZE : page * PAGE_SIZE]
    # Each queued job's pending reason, as `poolctl show` gives it (one that ended since is left out).
    queued = [r.id for r in shown if r.state == JobState.QUEUED]
    try:
        snap.reasons |= await request.app[HANDLERS].pending.of([i for i in queued if i not in snap.reasons])
    except RedisError:
        raise PageError(503, REDIS_DOWN) from None
    reasons = {i: snap.reasons[i] for i in queued if i in snap.reasons}
    filters = {"user": user, "queue": queue, "state": state}
    chosen = {k: v for k, v in filters.items() if v}

    def link(**changes: Any) -> str:
        return "/jobs?" + urlencode(
            chosen | {"sort": sort, "order": "desc" if descending else "asc"} | changes
        )

    flip = {key: "asc" if key == sort and descending else "desc" for key in SORTS}
    return "jobs.html", {
        "rows": shown,
        "reasons": reasons,
        "count": len(rows),
        "page": page,
        "pages": pages,
        "sort": sort,
        "order": "desc" if descending else "asc",
        "filters": filters,
        "users": sorted({r.user for r in snap.rows}),
        "queue_names": sorted(snap.queues),
        "state_names": [s.value for s in JobState],
        "sort_links": {key: link(sort=key, order=flip[key], page=1) for key in SORTS},
        "prev_link": link(page=page - 1) if page > 1 else "",
        "next_link": link(page=page + 1) if page < pages else "",
    }


# -- one job ----------------------------------------------------------------------------------------


async def job(request: web.Request) -> Page:
    detail: JobDetail = await ask(request, ShowJob(request.match_info["job_id"]))
    record = detail.job
    if "array" in record:
        raise PageError(400, f"{record['id']} is an array; its jobs are listed at /jobs")
    spec = record.get("spec") or {}
    mine = may_act(request, str(spec.get("user", "")))
    state = str(record.get("state", ""))
    return "job.html", {
        "job": record,
        "spec": spec,
        "mine": mine,
        "active": state in (JobState.QUEUED, JobState.RUNNING),
        "artifacts": (record.get("result") or {}).get("artifacts") or [],
        "attempts": record.get("attempts") or [],
        "usage": record.get("gpu_usage"),
        "usage_gpus": charts.usage_bars(record.get("gpu_usage")),
        "idle": record.get("idle_gpu"),
    }


async def cancel(request: web.Request) -> web.StreamResponse:
    job_id = request.match_info["job_id"]
    answer = await ask(request, CancelJobs([job_id]))
    outcome = answer.states.get(job_id, "")
    if outcome == "not_found":
        raise PageError(404, f"no job {job_id} in this pool")
    if outcome == "not_yours":
        owner = (await ask(request, ShowJob(job_id))).job.get("spec", {}).get("user", "another user")
        raise PageError(403, f"job {job_id} belongs to {owner}: only its owner or a pool admin may cancel it")
    raise web.HTTPSeeOther(f"/jobs/{job_id}")


async def artifact(request: web.Request) -> web.StreamResponse:
    """One artifact of a job: to the store's presigned URL, or from the local store's file."""
    job_id, key = request.match_info["job_id"], request.query.get("key", "")
    if not key.startswith(f"artifacts/{job_id}/"):
        raise PageError(400, f"{key!r} is not an artifact of job {job_id}")
    ticket: DownloadTicket = await ask(request, PrepareDownload(key))
    if ticket.url is not None:
        raise web.HTTPSeeOther(ticket.url)
    assert ticket.local_store is not None
    path = LocalStore(Path(ticket.local_store)).data_path(key)
    name = key.rsplit("/", 1)[-1]
    disposition = content_disposition_header("attachment", filename=name)  # quoted as the header needs
    return web.FileResponse(path, headers={"Content-Disposition": disposition})


# -- one worker -------------------------------------------------------------------------------------


async def worker(request: web.Request) -> Page:
    worker_id = request.match_info["worker_id"]
    snap = await _snapshot(request)
    record = next((w for w in snap.workers if w.get("id") == worker_id), None)
    if record is None:
        raise PageError(404, f"no worker {worker_id} in this pool (a stopped one is forgotten)")
    running = [r for r in snap.rows if r.worker == worker_id and r.state == JobState.RUNNING]
    return "worker.html", {"worker": _worker_view(record, snap.history), "running": running}
