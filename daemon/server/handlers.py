"""What the server does for each request: the queue operations behind the wire protocol.

`Handlers.handle` takes one decoded request and the authenticated user, sends any streamed items
through `send`, and returns the final reply. Errors come back as `GpupoolError`s, each carrying its
protocol error code and sentence (daemon/errors.py); the session turns them into ERROR frames. The
store's and Redis's own errors are turned into such sentences here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from redis.exceptions import RedisError

from daemon.errors import (
    GpupoolError,
    InvalidJob,
    JobNotFound,
    NotYours,
)
from daemon.job import JobInfo, JobState
from daemon.listing import selected, shortened, within_bytes
from daemon.metrics.server import ServerMetrics
from daemon.object_store import artifact_job
from daemon.queue.failures import out_of_memory
from daemon.queue.job_queue import JobQueue
from daemon.queue.registry import registered_workers
from daemon.queue.terminal_events import JobEvents
from daemon.server import accounting, channels
from daemon.server.admission import Admission
from daemon.server.agents import Agents
from daemon.server.bounds import SubmitBounds
from daemon.server.channels import ClientEnd
from daemon.server.data_desk import DataDesk
from daemon.server.log_limit import LogLimit
from daemon.server.pending import MAX_LIST, PendingReasons, WorkerLister
from daemon.server.relay_budget import RelayBudget
from daemon.spec_checks import ARRAY_ID
from daemon.webhook_targets import Allowed
from protocol import (
    Account,
    AgentCall,
    CancelJobs,
    Cancelled,
    ChannelClosed,
    CheckObjects,
    Enqueue,
    EnqueueBatch,
    ErrorCode,
    FinishUpload,
    FollowLogs,
    JobDetail,
    JobEnded,
    JobList,
    ListJobs,
    ListWorkers,
    LogChunk,
    LogEnd,
    OpenChannel,
    Ping,
    Pong,
    PoolView,
    PrepareDownload,
    PrepareUpload,
    Reply,
    Request,
    Requeued,
    RequeueJobs,
    ResolveName,
    ServeJobs,
    ShowJob,
    StreamItem,
    Waited,
    WaitJobs,
    WatchEnded,
    WatchPool,
    WorkerList,
)
from storage.base import InvalidKey, ObjectStore, StorageError

log = logging.getLogger(__name__)

MAX_IDS = 10_000  # job ids in one cancel or wait: more is refused, never worked through for minutes
# Requests that hold a blocking Redis read for as long as they last (`logs -f`, `wait`), or poll it
# (live views): each user has this many at once, so one user cannot take every Redis connection
# from everyone else.
MAX_BLOCKING_PER_USER = 16
# Channels into jobs (exec, attach, forward) read Redis as long as they last too, and have a bound of
# their own, so that a forward serving a browser's many connections (a JupyterLab: some 14) does
# not take the user's `logs -f` and `wait`, nor they its connections.
MAX_CHANNELS_PER_USER = 32
# ... and all users together this many: each holds a Redis connection, and Redis serves workers too.
MAX_BLOCKING = 512
LOG_BLOCK_SECONDS = 1.0
WAIT_RECHECK = 2.0  # seconds between looks at the state of jobs a `wait` waits for
WATCH_INTERVAL = (0.5, 3600.0)  # the fewest and most seconds between the views a watch streams

HIDDEN = "<hidden>"  # an environment value shown to a user who does not own the job

SendStream = Callable[[StreamItem], Awaitable[None]]


class Handlers:
    def __init__(
        self,
        queue: JobQueue,
        events: JobEvents,
        workers: WorkerLister,
        metrics: ServerMetrics | None = None,
        store: ObjectStore | None = None,
        *,
        admins: frozenset[str] = frozenset(),
        max_priority: Mapping[str, int] | None = None,
        default_max_priority: int = 0,
        notify_allowed: Allowed | None = None,
        bounds: SubmitBounds | None = None,
        agents: Agents | None = None,
    ) -> None:
        """`admins` may act on every user's jobs; everyone else on their own (docs/SECURITY.md).
        A job's --priority may reach its user's `max_priority` (an admin's: any), else
        `default_max_priority`. A job's --notify URL may name an address only where
        `notify_allowed` allows it (config notify_allow; webhook_targets.py). `bounds`: how
        large a job's spec and name may be; a user's jobs queued or running in one queue are
        bounded by `queue.max_unended` (bounds.py). `agents`: the agent workers' requests
        (agents.py; None: refused)."""
        self.queue = queue
        self._blocking: Counter[str] = Counter()  # user -> follows and waits running now
        self._channels: Counter[str] = Counter()  # user -> channels open now
        self.events = events
        self.workers = workers
        self.metrics = metrics
        self.data = DataDesk(store) if store is not None else None
        self.admission = Admission(
            queue,
            self.data,
            metrics,
            admins=admins,
            max_priority=max_priority,
            default_max_priority=default_max_priority,
            notify_allowed=notify_allowed,
            bounds=bounds,
        )
        self.pending = PendingReasons(queue, workers)  # why a queued job waits
        self.warnings = LogLimit()  # what users' requests cause, per user (the sessions' too)
        self.agents = agents
        self.relay_budget = RelayBudget()  # each user's share of what channels relay (poolctl exec)
        self.accountant = accounting.Accountant()  # `poolctl acct`: one request of each user at a time

    @property
    def admins(self) -> frozenset[str]:
        """Who may act on every user's jobs: admission's (one set, which a reload replaces)."""
        return self.admission.admins

    async def handle(
        self, request: Request, user: str, send: SendStream, client: ClientEnd | None = None
    ) -> Reply:
        """`client`: an open_channel's client end (the session's: channels.py)."""
        try:
            if isinstance(request, ServeJobs | AgentCall):
                return await self._agent(request, user, send)
            if isinstance(request, OpenChannel):
                assert client is not None, "a channel needs its client's end"
                return await self._channel(request, user, client)
            if isinstance(request, Account):
                queues = await self.queue.queues()
                return await self.accountant.answer(self.queue.redis, queues, request, user, self.admins)
            return await self._dispatch(request, user, send)
        except InvalidKey as exc:  # the caller's key, refused before the store was asked
            raise GpupoolError(exc.message, ErrorCode.INVALID_ARGUMENT) from None
        except StorageError as exc:
            what = type(request).__name__
            self.warnings.warning(log, user, "request %s of %s failed: object store (%s)", what, user, exc)
            raise GpupoolError(
                f"the pool's object store failed: {exc.message}", ErrorCode.UNAVAILABLE
            ) from None
        except RedisError as exc:
            what = type(request).__name__
            if out_of_memory(exc):
                self.warnings.warning(
                    log, user, "request %s of %s refused: Redis is at its maxmemory", what, user
                )
                raise GpupoolError(
                    "the pool's Redis is full (maxmemory reached): nothing new is taken until it has "
                    "room; retry later, and tell the pool's admin",
                    ErrorCode.UNAVAILABLE,
                ) from None
            self.warnings.warning(
                log, user, "request %s of %s failed: Redis unavailable (%s)", what, user, exc
            )
            raise GpupoolError(
                "the pool's Redis is unreachable right now; retry in a moment", ErrorCode.UNAVAILABLE
            ) from None

    async def _dispatch(self, request: Request, user: str, send: SendStream) -> Reply:
        match request:
            case Enqueue(spec=spec, idempotency_key=key):
                return await self.admission.enqueue(spec, key, user)
            case EnqueueBatch(specs=specs):
                return await self.admission.enqueue_batch(specs, user)
            case ListJobs():
                return JobList(await self._list(request, user), filtered=True)
            case ShowJob(job_id=job_id) if ARRAY_ID.fullmatch(job_id):
                return JobDetail(await self._array_summary(job_id))
            case ShowJob(job_id=job_id):
                info = await self.queue.get(job_id)
                return JobDetail(await self._detail(info, user))
            case CancelJobs(job_ids=job_ids):
                return Cancelled(await self._cancel(await self._expand(job_ids), user))
            case RequeueJobs(job_ids=job_ids):
                return Requeued(await self._requeue(await self._expand(job_ids), user))
            case WaitJobs() | FollowLogs() | WatchPool():
                return await self._streamed(request, user, send)
            case ListWorkers():
                return WorkerList(await self.workers())
            case Ping():
                return Pong(time.time())
            case PrepareUpload() | CheckObjects() | FinishUpload() | ResolveName() | PrepareDownload():
                return await self._data(request, user)
        raise GpupoolError(f"this server does not handle {type(request).__name__}", ErrorCode.UNKNOWN_OP)

    async def _streamed(
        self, request: WaitJobs | FollowLogs | WatchPool, user: str, send: SendStream
    ) -> Reply:
        """The requests that stream, and last as long as what they follow."""
        match request:
            case WaitJobs(job_ids=job_ids, timeout=limit):
                job_ids = await self._expand(job_ids)
                for job_id in job_ids:
                    self._check_owner(await self.queue.get(job_id), user, "wait on")
                with self.blocking_read(user):
                    return await self._wait(job_ids, limit, send)
            case FollowLogs(job_id=job_id, follow=follow, offset=offset):
                self._check_owner(await self.queue.get(job_id), user, "read the log of")
                with self.blocking_read(user) if follow else contextlib.nullcontext():
                    return await self._logs(job_id, follow, offset, send)
        with self.blocking_read(user):
            return await self._watch(request, user, send)

    async def _channel(self, request: OpenChannel, user: str, client: ClientEnd) -> ChannelClosed:
        """A channel into a running job (channels.py): its owner's or an admin's; it holds one of
        the user's channels while it lasts (it reads Redis as `logs -f` does)."""
        channels.check_request(request)
        info = await self.queue.get(request.job_id)
        doing = {"forward": "forward to", "attach": "attach to"}.get(request.kind, "exec in")
        self._check_owner(info, user, doing)
        channels.check_running(info, request.kind)
        with self.blocking_read(user, channel=True):
            relay = channels.Relay(self.queue, info, request, user, client=client, budget=self.relay_budget)
            return await relay.run()

    async def _agent(self, request: ServeJobs | AgentCall, user: str, send: SendStream) -> Reply:
        """An agent's requests (agents.py). A serve_jobs lasts as long as its agent: it is bounded
        there, per user, not among the user's blocking reads."""
        if self.agents is None:
            raise GpupoolError("this server runs no agent workers", ErrorCode.UNAVAILABLE)
        if isinstance(request, ServeJobs):
            return await self.agents.serve(request, user, send)
        return await self.agents.call(request, user)

    async def _expand(self, ids: list[str]) -> list[str]:
        """Job ids, an array's id ("QUEUE@ID") standing for all its jobs (one the pool does not
        know stays, to be answered as not found)."""
        out: list[str] = []
        for i in _at_most(ids):
            out += (await self.queue.array_jobs(i) or [i]) if ARRAY_ID.fullmatch(i) else [i]
        return _at_most(out)

    async def _array_summary(self, array_id: str) -> dict[str, Any]:
        """`show` of an array: how many of its jobs are in each state."""
        ids = await self.queue.array_jobs(array_id)
        if not ids:
            raise JobNotFound(array_id)
        states: Counter[str] = Counter()
        for job_id in ids:
            try:
                states[(await self.queue.get(job_id)).state] += 1
            except JobNotFound:
                states["forgotten"] += 1
        return {"id": array_id, "array": {"jobs": len(ids), "states": dict(states), "ids": ids}}

    # -- who may do what ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def blocking_read(self, user: str, *, channel: bool = False) -> Iterator[None]:
        """Hold one of `user`'s MAX_BLOCKING_PER_USER blocking reads, or with `channel` one of
        their MAX_CHANNELS_PER_USER channels (and, either way, one of the server's MAX_BLOCKING)
        for the block's duration."""
        if self._blocking.total() + self._channels.total() >= MAX_BLOCKING:
            raise GpupoolError(
                f"the server already serves {MAX_BLOCKING} 'logs -f', 'wait', live views and channels, "
                "the most it takes at once; retry in a moment",
                ErrorCode.UNAVAILABLE,
            )
        held, most = (
            (self._channels, MAX_CHANNELS_PER_USER) if channel else (self._blocking, MAX_BLOCKING_PER_USER)
        )
        if held[user] >= most:
            what = (
                "channels (exec, shell, forwarded connections) open, the most one user may; close some"
                if channel
                else "'logs -f', 'wait' and live views running, the most one user may; end one, or wait "
                "for many jobs in one request"
            )
            raise GpupoolError(f"{user} already has {most} {what}", ErrorCode.UNAVAILABLE)
        held[user] += 1
        try:
            yield
        finally:
            held[user] -= 1
            if not held[user]:
                del held[user]

    def _may_act_on(self, info: JobInfo, user: str) -> bool:
        return info.spec.user == user or user in self.admins

    def _check_owner(self, info: JobInfo, user: str, action: str) -> None:
        if not self._may_act_on(info, user):
            raise NotYours(info.id, info.spec.user, action)

    def _view(self, info: JobInfo, user: str) -> dict[str, Any]:
        """The job's record as `user` may see it: whole for its owner and admins; for anyone else,
        what it is and where it stands, never its secrets: environment values, the content
        addresses of its data (each one a key to the bytes), its --notify URL, its outcome's result
        (output tail, artifacts). Such a record says so (`withheld`): a client then knows that an
        empty result is not the job's, and that the job is not this user's to act on."""
        record = info.to_dict()
        if not self._may_act_on(info, user):
            record["withheld"] = True
            spec = record["spec"]
            spec["env"] = dict.fromkeys(spec.get("env") or {}, HIDDEN)
            spec["inputs"] = [{"dest": i["dest"], "kind": i["kind"]} for i in spec.get("inputs") or ()]
            if spec.get("snapshot"):
                spec["snapshot"] = {"commit": spec["snapshot"]["commit"]}
            if spec.get("project"):  # its packs are keys to its files
                spec["project"] = {k: v for k, v in spec["project"].items() if k != "packs"}
            if spec.get("git"):  # https://user:token@host/repo: the credentials are the owner's
                spec["git"] = {**spec["git"], "repo": re.sub(r"//[^/@]*@", "//", spec["git"]["repo"])}
            if spec.get("notify"):  # a webhook's URL is often its only key
                spec["notify"] = HIDDEN
            record["result"] = {}
        return record

    async def _data(
        self,
        request: PrepareUpload | CheckObjects | FinishUpload | ResolveName | PrepareDownload,
        user: str,
    ) -> Reply:
        if self.data is None:
            raise GpupoolError("this server has no object store for datasets", ErrorCode.UNAVAILABLE)
        match request:
            case PrepareUpload(sha256=sha256, size=size):
                return await self.data.prepare_upload(sha256, size, user)
            case CheckObjects(sha256s=sha256s):
                return await self.data.check_objects(sha256s, user)
            case FinishUpload(sha256=sha256, kind=kind, name=name):
                return await self.data.finish_upload(sha256, kind, name, user)
            case ResolveName(name=name):
                return await self.data.resolve(name, user)
            case PrepareDownload(key=key):
                if (job_id := artifact_job(key)) is not None:
                    self._check_owner(await self.queue.get(job_id), user, "download the artifacts of")
                elif user not in self.admins:
                    # Datasets reach jobs through the workers, never back to users: knowing an
                    # object's sha256 (from a job record, a log) must not be a key to its bytes.
                    raise GpupoolError(
                        f"{key!r} is a content address: only pool admins may download by one; "
                        "your jobs' artifacts come with 'poolctl get JOB'",
                        ErrorCode.PERMISSION_DENIED,
                    )
                return await self.data.prepare_download(key)

    async def _list(self, request: ListJobs | WatchPool, user: str) -> list[dict[str, Any]]:
        """The jobs `request` asks for. Its filters (state, user, name) are applied here, to the
        most jobs a listing reads (MAX_LIST), before its limit: a user's own jobs are found among
        everyone's, and no one else's are sent."""
        state = request.state
        if state is not None and state not in set(JobState):
            raise GpupoolError(
                f"unknown state {state!r}; one of {', '.join(JobState)}", ErrorCode.INVALID_ARGUMENT
            )
        if request.queue is not None:
            await self._check_queue(request.queue)
        limit = max(1, min(request.limit, MAX_LIST))
        finished = request.include_finished or (state is not None and JobState(state).terminal)
        narrowed = state is not None or request.user is not None or request.name is not None
        jobs = await self.queue.list_jobs(
            request.queue, include_finished=finished, limit=MAX_LIST if narrowed else limit
        )
        if narrowed:
            jobs = [
                j
                for j in jobs
                if (state is None or j.state == state)
                and selected(j.spec.user, j.spec.name, j.spec.argv, request.user, request.name)
            ]
            jobs = jobs[-limit:] if finished else jobs[:limit]  # the newest; the soonest to start
        why = (
            await self.pending.of([j.id for j in jobs if j.state is JobState.QUEUED])
            if request.reasons
            else {}
        )
        # Each record cut to what a listing shows, the whole within its bytes (daemon/listing.py):
        # one user's long fields cannot make the reply too large to send to anyone.
        return within_bytes(
            shortened(self._view(j, user) | ({"pending_reason": why[j.id]} if j.id in why else {}))
            for j in jobs
        )

    async def _check_queue(self, name: str) -> None:
        """A queue the pool knows: one that ever had a job, or that a worker serves."""
        known = set(await self.queue.queues())
        if name in known:
            return
        known |= {q for w in await registered_workers(self.queue.redis) for q in w.get("queues") or ()}
        if name not in known:
            raise GpupoolError(
                f"no queue {name!r} in this pool: no job was ever queued there and no worker serves it "
                f"(its queues: {', '.join(sorted(known)) or 'none yet'})",
                ErrorCode.INVALID_ARGUMENT,
            )

    async def _detail(self, info: JobInfo, user: str) -> dict[str, Any]:
        detail = self._view(info, user)
        if info.state is JobState.QUEUED:
            detail["pending_reason"] = await self.pending.reason(info)
        return detail

    async def _cancel(self, job_ids: list[str], user: str) -> dict[str, str]:
        """Each job's state after the request: cancelled (or how it had ended), "not_found", or
        "not_yours" for another user's job, left as it was."""
        return await self._each(job_ids, user, self.queue.cancel)

    async def _requeue(self, job_ids: list[str], user: str) -> dict[str, str]:
        """Each job's answer: "requeueing" (a running job, being stopped, to run again), or why
        not: its state, "not_found", or "not_yours" for another user's job, left as it was."""
        return await self._each(job_ids, user, self.queue.requeue)

    async def _each(
        self, job_ids: list[str], user: str, act: Callable[[str], Awaitable[str]]
    ) -> dict[str, str]:
        states = {}
        for job_id in job_ids:
            try:
                if not self._may_act_on(await self.queue.get(job_id), user):
                    states[job_id] = "not_yours"
                    continue
                states[job_id] = await act(job_id)
            except (JobNotFound, InvalidJob):
                states[job_id] = "not_found"
        return states

    async def _wait(self, job_ids: list[str], limit: float | None, send: SendStream) -> Waited:
        """Stream each of `job_ids` as it ends, then the Waited reply. A job is read when its
        end's event tells of it (one read each, however many are waited for), and every job
        still waited for at each WAIT_RECHECK: an event may be lost, and a job's end is then
        seen there."""
        deadline = None if limit is None else time.monotonic() + limit
        jobs: dict[str, JobInfo] = {}
        unended = list(dict.fromkeys(job_ids))  # (an id given twice is read once)
        async with self.events.watching(unended) as changes:
            look = unended  # all of them, first
            while True:
                for j in await self.queue.get_many(look):
                    jobs[j.id] = j
                    if j.state.terminal:
                        await send(JobEnded(j.to_dict()))
                unended = [i for i in unended if not jobs[i].state.terminal]
                left = None if deadline is None else deadline - time.monotonic()
                if not unended or (left is not None and left <= 0):
                    return Waited([jobs[i].to_dict() for i in job_ids], timed_out=bool(unended))
                try:
                    async with asyncio.timeout(WAIT_RECHECK if left is None else min(left, WAIT_RECHECK)):
                        await changes.wait()
                    ended = changes.take()
                    look = [i for i in unended if i in ended]
                except TimeoutError:
                    changes.take()
                    look = unended

    async def _watch(self, request: WatchPool, user: str, send: SendStream) -> WatchEnded:
        """A PoolView every `interval` seconds (WATCH_INTERVAL's range), until cancelled or
        `count` views are sent; the jobs are what ListJobs would list."""
        interval = min(max(request.interval, WATCH_INTERVAL[0]), WATCH_INTERVAL[1])
        views = 0
        while True:
            jobs = await self._list(request, user)
            await send(PoolView(jobs, await self.workers(), time.time(), filtered=True))
            views += 1
            if views == request.count:
                return WatchEnded(views)
            await asyncio.sleep(interval)

    async def _logs(self, job_id: str, follow: bool, offset: str, send: SendStream) -> LogEnd:
        """The job's log after `offset`; with `follow`, until the job has ended and its last chunk
        is sent, which is as soon as it ends (follow_log wakes at its queue's terminal events)."""
        info = await self.queue.get(job_id)  # NOT_FOUND before anything is streamed
        after = offset or "0-0"

        async def forward(chunks: list[tuple[str, bytes]]) -> None:
            nonlocal after
            for entry_id, data in chunks:
                await send(LogChunk(data, entry_id))
                after = entry_id

        while follow and not info.state.terminal:
            # The queue's newest end first, then the job's state: an end after the mark wakes the
            # read below at once. Looked at again at each end in the queue, and every
            # LOG_BLOCK_SECONDS in any case (an event may be lost).
            ended_mark = await self.queue.last_event_id(info.spec.queue)
            info = await self.queue.get(job_id)
            look_again = info.state.terminal
            while not look_again:
                chunks, one_ended = await self.queue.follow_log(
                    job_id, after, ended_mark, block=LOG_BLOCK_SECONDS
                )
                await forward(chunks)
                look_again = one_ended or not chunks
        # The rest: with the job ended, all of its output (written before its end).
        while chunks := await self.queue.read_log(job_id, after):
            await forward(chunks)
        return LogEnd(str(info.state), info.exit_code)


def _at_most(job_ids: list[str]) -> list[str]:
    if len(job_ids) > MAX_IDS:
        raise GpupoolError(
            f"{len(job_ids)} job ids in one request; at most {MAX_IDS}: send them in several",
            ErrorCode.INVALID_ARGUMENT,
        )
    return job_ids
