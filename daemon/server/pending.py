"""Why a queued job waits, in the sentence `poolctl show` and the dashboard give: what it waits
for (a job it depends on, a worker reserved for it till what it needs is free there, a worker with
enough GPUs, a worker for its queue, its user's cap or turn in a fair-share queue), else its place
in line. What the scheduler decides
(caps, fair share's ranking, a job too big for every worker) is its own verdict, read through
queue/explain.py: it is put in words here, never judged again. That verdict is a claim's by one
worker with the most of each resource any live worker has; whether one worker has all the job
needs together is admission's own check (worker_fit.py), asked of the live workers."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from daemon.errors import JobNotFound
from daemon.job import JobInfo, JobState
from daemon.queue.explain import Explanation, explain
from daemon.queue.job_queue import JobQueue
from daemon.server import worker_fit
from daemon.server.dependencies import weigh

MAX_LIST = 10_000  # the most jobs listed (ls), read for a reason, or asked about at once
_WHEN_ONE_JOINS = "the jobs behind it run meanwhile, and it starts when such a worker joins"
WorkerLister = Callable[[], Awaitable[list[dict[str, Any]]]]


class PendingReasons:
    def __init__(self, queue: JobQueue, workers: WorkerLister) -> None:
        self.queue = queue
        self.workers = workers

    async def of(self, job_ids: list[str]) -> dict[str, str]:
        """Why each of the queued `job_ids` waits, as `show` says it (a job that is not queued, or
        not known, is left out); what the jobs share (a queue's order, the workers) is read once."""
        memo: dict[str, Any] = {"asked": job_ids[:MAX_LIST]}
        out = {}
        for job_id in job_ids[:MAX_LIST]:
            with contextlib.suppress(JobNotFound):
                info = await self.queue.get(job_id)
                if info.state is JobState.QUEUED:
                    out[job_id] = await self.reason(info, memo)
        return out

    async def reason(self, info: JobInfo, memo: dict[str, Any] | None = None) -> str:
        """Why `info`, a queued job, waits. `memo` keeps the reads other jobs' reasons share (`of`)."""
        memo = {} if memo is None else memo
        if info.spec.held and info.id in await self.queue.waiting(info.spec.queue):
            return await self._held_reason(info)
        if info.spec.retries and (at := await self.queue.retry_at(info.id)) is not None:
            failed = info.detail or f"exit {info.exit_code}"
            return (
                f"its attempt {info.attempt} failed ({failed}): it goes back to the front of queue "
                f"{info.spec.queue!r} at {time.strftime('%H:%M:%S', time.localtime(at))}, after its "
                "retry back-off"
            )
        if (queued := memo.get(f"order:{info.spec.queue}")) is None:  # ids, in the order they start
            queued = memo[f"order:{info.spec.queue}"] = await self.queue.start_order(
                info.spec.queue, MAX_LIST
            )
        ahead = queued.index(info.id) if info.id in queued else len(queued)
        if (reserved := await self.queue.reservation(info.id)) is not None:
            worker, at = reserved
            when = (
                f"expected by {time.strftime('%H:%M:%S', time.localtime(at))}, when its running jobs' "
                "time limits end"
                if at > time.time() + 1
                else "expected as soon as its running jobs end (not all have a time limit)"
            )
            # All it needs free there at once (claim/backfill.lua): GPUs, CPUs, memory; a job
            # asking for none of them waits for a slot's share of the worker's GPUs.
            needs = worker_fit.needs(info.spec) or "its GPUs"
            return (
                f"waiting for {needs}; reserved on {worker}, {when}; jobs behind it start meanwhile "
                "where they cannot delay it"
            )
        if (workers := memo.get("workers")) is None:
            workers = memo["workers"] = [w for w in await self.workers() if w.get("health") == "healthy"]
        judged = await self._explained(info, workers, memo)
        if judged.verdict == "park":  # more than every live worker has (claim/fit.lua)
            nobody = "and no live worker has that"
            need = {
                "no_gpu_memory": f"{_memory(info.spec.gpu_mem)} on one GPU, "
                "and no live worker's GPU has that much",
                "too_many_cpus": f"{info.spec.cpus} CPUs, {nobody} many for jobs",
                "too_much_memory": f"{_memory(info.spec.mem)} of memory, {nobody} much for jobs",
            }.get(judged.reason, f"{info.spec.gpus} GPUs, {nobody} many")
            return f"needs {need}: {_WHEN_ONE_JOINS}"
        serving = [w for w in workers if info.spec.queue in w.get("queues", ())]
        if worker_fit.none_holds(info.spec, serving):  # no one worker has all of it together
            return (
                f"needs {worker_fit.needs(info.spec)} on one worker, and no live worker serving queue "
                f"{info.spec.queue!r} has them all: {_WHEN_ONE_JOINS}"
            )
        rank = (
            f" (priority {info.spec.priority}: before the queue's jobs of lower priority)"
            if info.spec.priority
            else ""
        )
        place = (
            f"{ahead} job(s) ahead of it in queue {info.spec.queue!r}" if ahead else "next to start"
        ) + rank
        fair = info.spec.queue in self.queue.fairshare and not info.spec.priority
        if judged.verdict == "hold" or (not fair and judged.place == "held"):
            return self._cap_reason(info)
        if not any(info.spec.queue in w.get("queues", ()) for w in workers):
            return f"no live worker serves queue {info.spec.queue!r} (when one does: {place})"
        if fair:  # its user's turn comes by recent use, not by place
            return self._fair_reason(info, judged)
        return place

    async def _explained(
        self, info: JobInfo, workers: list[dict[str, Any]], memo: dict[str, Any]
    ) -> Explanation:
        """The scheduler's verdict on `info` (queue/explain.py), as judged by a claim of a worker
        as big as the biggest live one (its GPUs, and its largest GPU's memory); the queued jobs
        of its queue that `of` was asked about are judged in the same call."""
        q = info.spec.queue
        judged: dict[str, Explanation] = memo.setdefault(f"explained:{q}", {})
        if info.id not in judged:
            asked = [i for i in memo.get("asked", ()) if i not in judged and i.startswith(f"{q}.")]
            gpus = [w.get("gpus", ()) for w in workers]
            # A GPU quarantined for its health is not counted: the worker's claims do not count it.
            most = max((sum(1 for one in g if not one.get("health")) for g in gpus), default=0)
            memory = max((int(one.get("memory", 0)) for g in gpus for one in g), default=0)
            judged |= await explain(
                self.queue,
                q,
                list(dict.fromkeys([info.id, *asked])),
                most,
                memory,
                host_most=_host_most(workers),
            )
        return judged[info.id]

    async def _held_reason(self, info: JobInfo) -> str:
        """A job held out of its queue: what it waits for, or its array's window."""
        if deps := await self.queue.dependencies(info.id):
            verdict, why = await weigh(self.queue, deps)
            if verdict != "ready":
                return why if verdict == "wait" else f"about to be {why}"
        if info.spec.array and info.spec.array_limit:
            under_way, window = await self.queue.array_window(info.spec.array)
            return (
                f"waiting for a place in array {info.spec.array}: {under_way} of its jobs under way, "
                f"at most {window} at once (%{window}); the next by index goes in as one ends"
            )
        return "about to start"

    def _cap_reason(self, info: JobInfo) -> str:
        jobs, gpus = self.queue.user_caps
        caps = " or ".join(c for c in (jobs and f"{jobs} running jobs", gpus and f"{gpus} GPUs") if c)
        return (
            f"{info.spec.user} is at the cap of {caps} per user in queue {info.spec.queue!r}: it "
            "starts, before the jobs behind it, once one of theirs there ends"
        )

    def _fair_reason(self, info: JobInfo, judged: Explanation) -> str:
        """A job waiting its user's turn in a fair-share queue: who goes first, and why."""
        q, user = info.spec.queue, info.spec.user
        mine = f"{user}: {judged.use / 3600:.2f} GPU-hours of recent use, weight {judged.weight:g}"
        if first := judged.first:
            who = ", ".join(first[:5]) + (f" and {len(first) - 5} more" if len(first) > 5 else "")
            verb = "goes" if len(first) == 1 else "go"
            return f"fair share in queue {q!r}: {who} {verb} first: less recent use ({mine})"
        return (
            f"fair share in queue {q!r}: {user} goes next, with the least recent use of those "
            f"waiting ({mine})"
        )


def _memory(nbytes: int) -> str:
    return f"{nbytes / 2**30:g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:g} MiB"


def _host_most(workers: list[dict[str, Any]]) -> tuple[int, int]:
    """The most CPUs and bytes of memory for jobs of any of `workers`; (0, 0), not counted, when
    one of them does not count them (worker/host.py): it would take any job. The two may be two
    workers' (`reason` asks worker_fit whether one has both)."""
    if not workers or not all(int(w.get("job_memory") or 0) for w in workers):
        return 0, 0
    return max(int(w.get("cpus", 0)) for w in workers), max(int(w["job_memory"]) for w in workers)
