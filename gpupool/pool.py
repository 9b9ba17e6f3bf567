"""`gpupool.connect()`: a Pool, the one connection through which this process submits, waits,
cancels and fetches.

The pool is chosen as poolctl chooses it (daemon/pools.py `choose`: server=, pool=,
GPUPOOL_SERVER, GPUPOOL_POOL, pools.toml, 127.0.0.1:7420), with the same user and token. Its
connection (daemon/client/pool_client.py) lives on the API's own loop (gpupool/_loop.py); every
blocking method runs its requests there and waits for them. Jobs run the call in a copy of the
project this process runs in, with its environment (`Options.project`), as `poolctl enqueue` does.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from daemon.aio import cancel_and_wait
from daemon.client.pool_client import ClientError, PoolClient
from daemon.ctl import project_send
from daemon.ctl.arrays import MAX_JOBS, array_specs
from daemon.ctl.link import Link, reach
from daemon.ctl.parsing import UsageError
from daemon.errors import GpupoolError, NotYours
from daemon.spec_checks import ARRAY_ID, JOB_ID
from gpupool import _loop, shipping
from gpupool.errors import BadArgument, Error, JobFailed
from gpupool.job import Job
from gpupool.options import Options, names
from gpupool.watch import FIRST_BACKOFF_SECONDS, MAX_BACKOFF_SECONDS, REFUSALS, watch_for
from protocol import (
    Enqueue,
    EnqueueBatch,
    Enqueued,
    EnqueuedBatch,
    ErrorCode,
    JobDetail,
    Reply,
    Request,
    ShowJob,
)

if TYPE_CHECKING:
    from gpupool.executor import PoolExecutor

R = TypeVar("R", bound=Reply)
AGAIN = "pool.job(id) from a new connection waits for it again"
UNSET: Any = object()  # an option submit was not given: the pool's default (None clears one)
log = logging.getLogger(__name__)


def connect(pool: str | None = None, *, server: str | None = None, **defaults: Any) -> Pool:
    """The pool named `pool` in pools.toml, or at `server` (HOST:PORT, unix:PATH), or the one
    poolctl would talk to; `defaults`: job options for every job submitted through it (gpus=,
    queue=, project=..., gpupool.options.Options). Connects at once: a pool that does not answer,
    or refuses the token, raises here."""
    try:
        to = reach(server, pool, None, who="gpupool")
    except UsageError as exc:  # an address that cannot be one
        raise BadArgument(exc.message) from None
    chosen = Pool(to, Options(**_known(defaults)))
    try:
        _loop.run(chosen.client())
    except GpupoolError as exc:
        chosen.close()
        exc.message = in_api_words(exc.message)
        exc.args = (exc.message, *exc.args[1:])
        raise
    except BaseException:
        chosen.close()
        raise
    return chosen


POOLCTL_WORDS = (  # what a sentence written for poolctl says, and what it means here
    (
        "point poolctl at yours with --server HOST:PORT",
        "point gpupool.connect at yours with server='HOST:PORT'",
    ),
    ("--wait-for-worker", "wait_for_worker=True"),
    ("--workdir none", "project=False"),
)


def in_api_words(sentence: str) -> str:
    """A sentence of the pool's (written for poolctl's flags) in the API's keywords."""
    for flag, keyword in POOLCTL_WORDS:
        sentence = sentence.replace(flag, keyword)
    return sentence


def _known(options: dict[str, Any]) -> dict[str, Any]:
    if unknown := sorted(set(options) - set(names())):
        raise BadArgument(f"no job option {unknown[0]!r}; the options: {', '.join(names())}")
    return options


class Pool:
    """A connected pool. Use it as a context manager, or `close()` it. It belongs to the process
    that connected: a forked child connects a pool of its own."""

    def __init__(self, to: Link, defaults: Options) -> None:
        self.link = to
        self.defaults = defaults
        self._client: PoolClient | None = None
        self._connecting: asyncio.Lock | None = None
        self._jobs: dict[str, Job] = {}  # those waited for, by id: the watch tells of their ends
        self._finishing: dict[asyncio.Task[None], Job] = {}  # outcomes being fetched
        self._closed = False
        self._pid = os.getpid()  # the process it belongs to: a forked child shares its socket
        _open.add(self)

    def __repr__(self) -> str:
        return f"<gpupool.Pool {self.link.name or self.link.server} as {self.link.user}>"

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the connection (on the API's loop) ----------------------------------------------------

    def _mine(self) -> None:
        """Refuse use from a process this Pool does not belong to (a forked child): its
        connection is the parent's, and a request from here would mix with the parent's."""
        if os.getpid() != self._pid:
            raise Error(
                f"this Pool belongs to process {self._pid}: gpupool.connect() in the child (process "
                f"{os.getpid()}) for a pool of its own"
            )

    async def client(self) -> PoolClient:
        """The open connection, opened (again) when there is none."""
        if self._closed:
            raise Error("this pool was closed: gpupool.connect() again")
        self._mine()
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._client is None or self._client.closed is not None:
                if self._client is not None:
                    await self._client.close()
                client = self.link.client()
                await client.connect()
                self._client = client
            return self._client

    def call(self, request: Request, reply_type: type[R]) -> R:
        """One request and its reply (blocking)."""

        self._mine()

        async def call() -> R:
            return await (await self.client()).call(request, reply_type)

        return _loop.run(call())

    # -- submitting ----------------------------------------------------------------------------

    def submit(
        self,
        fn: Callable[..., Any],
        /,
        *args: Any,
        gpus: int = UNSET,
        gpu_mem: int | str | None = UNSET,
        queue: str | None = UNSET,
        timeout: float | None = UNSET,
        name: str | None = UNSET,
        cpus: int = UNSET,
        mem: int | str | None = UNSET,
        **kwargs: Any,
    ) -> Job:
        """Run `fn(*args, **kwargs)` in a job; its Job. The keyword options are the job's (left
        out: the pool's defaults; None clears one, as gpu_mem=None with gpus=1 on a pool connected
        with gpu_mem="20G"). A keyword of `fn` named like a job option is refused, not sent to
        `fn` nor taken as the job's: `pool.executor(**options).submit` for the other job options,
        functools.partial for the function's own."""
        if taken := sorted(set(kwargs) & set(names())):
            raise BadArgument(
                f"{taken[0]}= is a job option that submit does not take: "
                f"pool.executor({taken[0]}=...).submit(fn, ...) gives it to the job, and "
                f"submit(functools.partial(fn, {taken[0]}=...), ...) to the function"
            )
        chosen = {
            "gpus": gpus,
            "gpu_mem": gpu_mem,
            "queue": queue,
            "timeout": timeout,
            "name": name,
            "cpus": cpus,
            "mem": mem,
        }
        options = self.defaults.replace(**{k: v for k, v in chosen.items() if v is not UNSET})
        return self.submit_with(options, fn, args, kwargs)

    def submit_with(
        self, options: Options, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
    ) -> Job:
        """`submit` with all of a job's options given (the executor's way in)."""
        self._mine()
        data = shipping.archive(fn, [(tuple(args), dict(kwargs))])  # pickled here: the caller's objects
        ids = self._enqueue(options, data, 1, _name_of(fn))
        return self._track(ids)[0]

    def map(self, fn: Callable[..., Any], iterable: Iterable[Any], /, **options: Any) -> list[Job]:
        """`fn(item)` for each item, as one array of jobs (one upload, one request); their Jobs, in
        the order of the items. `options` as submit's (and the other job options)."""
        chosen = self.defaults.replace(**_known(options))
        return self.map_with(chosen, fn, [((item,), {}) for item in iterable])

    def map_with(self, options: Options, fn: Callable[..., Any], calls: Sequence[shipping.Call]) -> list[Job]:
        """`fn(*args, **kwargs)` for each (args, kwargs) of `calls`, as one array, with all of a
        job's options given (the executor's way in)."""
        self._mine()
        if not calls:
            return []
        if len(calls) > MAX_JOBS:
            raise BadArgument(
                f"{len(calls)} calls in one map; at most {MAX_JOBS} in one array: map them in parts"
            )
        data = shipping.archive(fn, calls)
        return self._track(self._enqueue(options, data, len(calls), _name_of(fn)))

    def run(self, argv: Sequence[str], /, **options: Any) -> Job:
        """Run the command `argv` (no shell) in a job, in the project as `poolctl enqueue` does;
        `result()` is its exit status, 0, and a job that fails raises gpupool.JobFailed."""
        if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
            raise BadArgument(f"run({argv!r}): the command as a list of strings, e.g. ['python', 'train.py']")
        chosen = self.defaults.replace(**_known(options))
        return self._track(self._enqueue(chosen, list(argv), 1, ""))[0]

    def job(self, job_id: str) -> Job:
        """The job `job_id` (its own, or one submitted from another process): a Job whose result
        comes as it would have to the process that submitted it."""
        if not isinstance(job_id, str) or not (JOB_ID.fullmatch(job_id) or ARRAY_ID.fullmatch(job_id)):
            raise BadArgument(f"pool.job({job_id!r}): a job's id, QUEUE.ID, e.g. 'default.mx6abc123'")
        if (known := self._jobs.get(job_id)) is not None:
            return known
        try:
            record = self.call(ShowJob(job_id), JobDetail).job
        except ClientError as exc:
            if exc.code == ErrorCode.NOT_FOUND:
                raise BadArgument(f"no job {job_id!r} in this pool") from None
            raise
        if "array" in record:
            raise BadArgument(f"{job_id} is an array's id: give one of its jobs' ids")
        if record.get("withheld"):  # the server keeps another user's call and result from us
            raise NotYours(record["id"], record["spec"]["user"], "wait for the result of")
        return self._track([record["id"]])[0]

    def executor(self, **options: Any) -> PoolExecutor:
        """A concurrent.futures.Executor whose `submit` returns Jobs with these options."""
        from gpupool.executor import PoolExecutor

        return PoolExecutor(self, self.defaults.replace(**_known(options)))

    def close(self) -> None:
        """Close the connection. Jobs not yet ended run on; their Jobs here fail (`pool.job(id)`
        from a new connection waits for them again). In a forked child it only marks the Pool
        closed: the connection is the parent's."""
        if self._closed:
            return
        self._closed = True
        _open.discard(self)
        if os.getpid() != self._pid:
            return
        if _loop.on_loop():  # from a done-callback's coroutine, say: closed when the loop gets to it
            _loop.loop().create_task(self._close())
        else:
            _loop.run(self._close())

    async def _close(self) -> None:
        watch = watch_for(self.link)
        for job_id in list(self._jobs):
            watch.drop(job_id, self)
        finishing = list(self._finishing.values())  # each task's end takes it out of the dict
        for task in list(self._finishing):
            await cancel_and_wait(task)
        if self._client is not None:
            await self._client.close()
        for job_id, job in self._jobs.items():
            _settle(job, error=Error(f"the pool was closed before job {job_id} ended; it runs on: {AGAIN}"))
        for job in finishing:
            _settle(job, error=Error(f"the pool was closed while the result of job {job.id} came: {AGAIN}"))
        self._jobs.clear()

    # -- what the watch and the jobs call back (on the API's loop) ----------------------------

    def forget(self, job_id: str) -> None:
        """Wait no more for `job_id` (cancelled)."""
        self._jobs.pop(job_id, None)
        _loop.loop().call_soon_threadsafe(watch_for(self.link).drop, job_id, self)

    def _track(self, job_ids: list[str]) -> list[Job]:
        jobs = [self._jobs.setdefault(job_id, Job(self, job_id)) for job_id in job_ids]

        def add() -> None:
            if not self._closed:
                watch_for(self.link).add(job_ids, self)

        _loop.loop().call_soon_threadsafe(add)
        return jobs

    def _ended(self, record: dict[str, Any]) -> None:
        job = self._jobs.pop(record["id"], None)
        if job is not None and not job.done():
            task = asyncio.create_task(self._finish(job, record), name=f"gpupool-finish-{job.id}")
            self._finishing[task] = job
            task.add_done_callback(self._finishing.pop)

    def _failed(self, job_id: str, error: BaseException) -> None:
        job = self._jobs.pop(job_id, None)
        if job is not None:
            _settle(job, error=error)

    async def _finish(self, job: Job, record: dict[str, Any]) -> None:
        """Fetch the ended job's outcome, through connections that fail and come back (its bytes
        only: `Job.result` unpickles them), and set it."""
        backoff = FIRST_BACKOFF_SECONDS
        while True:
            try:
                value = await self._outcome(record)
            except ClientError as exc:
                if exc.code in REFUSALS or self._closed:
                    _settle(job, error=exc)
                    return
                log.warning("fetching the result of job %s failed (%s); trying again", job.id, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
            except Exception as exc:  # noqa: BLE001 - the job's outcome, for whoever waits on it
                _settle(job, error=exc)
                return
            else:
                _settle(job, value=value)
                return

    async def _outcome(self, record: dict[str, Any]) -> Any:
        item = shipping.result_artifact(record)
        if item is not None:
            owner = record["spec"]["user"]
            if owner != self.link.user:  # an admin's view of another's job: her pickle would run here
                raise Error(
                    f"job {record['id']} belongs to {owner}: its result is a pickle that {owner}'s job "
                    f"wrote, and loading it would run that job's code here as {self.link.user}; "
                    "job.artifacts(dest) downloads it as a file",
                    ErrorCode.PERMISSION_DENIED,
                )
            data = await shipping.fetch(await self.client(), record, item)
            return shipping.Fetched(record["id"], record["state"], record.get("detail") or "", data)
        if record["state"] == "succeeded" and not shipping.is_function_job(record):
            return record.get("exit_code", 0)
        result = record.get("result") or {}
        why = [record.get("detail") or "", *(result.get("artifact_errors") or [])]  # an upload failed
        tail = "\n".join(result.get("tail") or [])
        raise JobFailed(record["id"], record["state"], "; ".join(w for w in why if w), tail)

    # -- the enqueue (on the API's loop) ------------------------------------------------------

    def _enqueue(self, options: Options, what: bytes | list[str], count: int, name: str) -> list[str]:
        """Queue `count` jobs (an array when more than one) running the archive `what` (a
        function's) or the command `what`; their ids."""
        spec = options.spec(what if isinstance(what, list) else ["python"], name)
        try:
            return _loop.run(self._send(options, spec, what, count))
        except BadArgument:
            raise
        except GpupoolError as exc:  # a refusal of what was asked (a queue no worker serves...)
            if exc.code == ErrorCode.INVALID_ARGUMENT:
                raise BadArgument(in_api_words(exc.message)) from None
            raise

    async def _send(
        self, options: Options, spec: dict[str, Any], what: bytes | list[str], count: int
    ) -> list[str]:
        client = await self.client()
        if (start := options.project_dir()) is not None:
            project = await project_send.send(client, start[0], named=start[1], required=False)
            if project is not None:
                spec["project"] = project
        if isinstance(what, bytes):
            spec["inputs"] = [await shipping.upload(client, what, spec["name"] or "a function's call")]
            spec["argv"] = shipping.argv(spec.get("project"))
        if count == 1:
            return [(await client.call(Enqueue(spec, None), Enqueued)).job_id]
        _, specs = array_specs(spec, list(range(count)), [], 0)
        return (await client.call(EnqueueBatch(specs), EnqueuedBatch)).job_ids


_open: weakref.WeakSet[Pool] = weakref.WeakSet()  # this process's Pools not closed


@atexit.register
def _close_at_exit() -> None:
    """Close the Pools left open, then stop the loop: their connections and watch end cleanly
    instead of asyncio's complaints about tasks destroyed while pending."""
    for pool in list(_open):
        if pool._pid == os.getpid():
            with contextlib.suppress(Exception):
                pool.close()
    _loop.stop()


def _name_of(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return name[:128]


def _settle(job: Job, *, value: Any = None, error: BaseException | None = None) -> None:
    """Set `job`'s outcome, unless it has one (it was cancelled meanwhile), on a settling thread:
    its done-callbacks run there, not on the API's loop (gpupool/_loop.py `settle`)."""

    def settle() -> None:
        try:
            if error is not None:
                job.set_exception(error)
            else:
                job.set_result(value)
        except concurrent.futures.InvalidStateError:
            pass

    _loop.settle(settle)
