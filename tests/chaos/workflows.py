"""The workflow features under the chaos (issue 43): what `run_chaos(workflows=True)` submits beside
its stream of plain jobs, in units spread over the stream, so that every fault lands among them.

One unit (UNIT_JOBS jobs, `unit`):

- a chain A -> B -> C (`--after X:ok`), each with `--notify` to the receiver as well as the pool's
  `notify_url`, and a time limit, so that the pilots may run them;
- F, made to fail (exit 3, no retries); G after F:ok, which can never run (cancelled), H after
  G:any (a cancelled job has ended: H runs), J after F:fail (runs);
- R, which fails its first attempt and has retries (a back-off, then the front), and S after R:ok
  and A:ok;
- two `%N` arrays sent as poolctl sends them (one batch, `daemon/ctl/arrays.py`): X, of 6 jobs
  `%2 --after C:ok`, and Y, of 6 jobs `%3` (jobs long enough that the window is full);
- K, a job that checkpoints (it saves who it is, and reads back whose save it found), in the
  default queue: the `requeue` fault stops it through RequeueJobs;
- in the GPU queue (workers with made-up GPUs): four one-GPU jobs that checkpoint, filling both
  GPU workers, then a job with a priority that preempts one of them; then two `--gpu-mem 30G` jobs,
  which share a GPU.

A submission is sent as a careful client sends it: with an idempotency key, again through faults;
a batch (which has none) that failed once sent is looked up by its array's id before it is sent
again, as poolctl names the array to cancel. The checker (tests/chaos/workflow_rules.py) derives
how each job must end from the records: F and its kind fail, a dependent whose dependency was not
met is cancelled, the rest succeed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from daemon.client.pool_client import ClientError
from daemon.ctl.arrays import array_specs
from daemon.job import JobState
from protocol import EnqueueBatch, EnqueuedBatch, JobDetail, ShowJob
from protocol.errors import ErrorCode
from tests.chaos.harness import FINAL, GPU_QUEUE, Cluster, Refused, Submitter, job_command

SHORT = 0.2  # seconds of a chain's job
ARRAY_SECONDS = 0.6  # long enough that an array's window is full while the next ones wait
CHECKPOINT_SECONDS = 2.0  # long enough for a requeue or a preemption to catch it running
FILL_SECONDS = 10.0  # the most a unit waits for its GPU jobs to run before the one that preempts
LIMIT = 4.0  # --timeout of the jobs a pilot may run: with its stop grace, well within its lifetime
GIB = 2**30
UNIT_JOBS = 29  # jobs in one unit, when nothing is refused


@dataclass
class Submitted:
    """What the workflow units put into the pool, for the checker."""

    fails: set[str] = field(default_factory=set)  # made to fail: they must end failed
    # submissions the server refused (by key), with the jobs they waited for: one of those must have
    # vanished (only Redis losing its last writes may take away a job a client was given)
    refused: dict[str, list[str]] = field(default_factory=dict)
    arrays: dict[str, list[str]] = field(default_factory=dict)  # array id -> its jobs
    units: int = 0


class Workflows:
    """Submits the workflow units through `submitter` (its ids are the jobs the pool must not lose)."""

    def __init__(self, cluster: Cluster, submitter: Submitter, hook_url: str) -> None:
        self.cluster = cluster
        self.submitter = submitter
        self.hook_url = hook_url
        self.done = Submitted()

    def _job(self, seconds: float, **kw: Any) -> dict[str, Any]:
        """A job spec of `seconds`; `exit_code`, `fail_first`, `checkpoint` shape its command."""
        command = {k: kw.pop(k) for k in ("exit_code", "fail_first", "checkpoint") if k in kw}
        return {"argv": job_command(self.cluster.ledger, seconds, **command), "max_attempts": 10, **kw}

    async def _one(self, key: str, spec: dict[str, Any]) -> str | None:
        """Submit one job; None when the server refused it (a job it waits for is not there)."""
        try:
            return await self.submitter.submit(key, spec)
        except Refused as exc:
            self.done.refused[key] = [d.rpartition(":")[0] for d in spec.get("after", [])]
            self.cluster.faults.note(f"{key} refused: {exc}")
            return None

    async def unit(self, u: int) -> None:
        """Submit unit `u` (module docstring)."""
        self.done.units += 1
        k = f"wf{u}"
        timed = {"timeout": LIMIT}
        a = await self._one(f"{k}-a", self._job(SHORT, notify=self.hook_url, **timed))
        b = a and await self._one(
            f"{k}-b", self._job(SHORT, after=[f"{a}:ok"], notify=self.hook_url, **timed)
        )
        c = b and await self._one(
            f"{k}-c", self._job(SHORT, after=[f"{b}:ok"], notify=self.hook_url, **timed)
        )
        f = await self._one(f"{k}-f", self._job(SHORT, exit_code=3, **timed))
        if f:
            self.done.fails.add(f)
            g = await self._one(f"{k}-g", self._job(SHORT, after=[f"{f}:ok"], **timed))
            if g:
                await self._one(f"{k}-h", self._job(SHORT, after=[f"{g}:any"], **timed))
            await self._one(f"{k}-j", self._job(SHORT, after=[f"{f}:fail"], **timed))
        r = await self._one(f"{k}-r", self._job(SHORT, fail_first=True, retries=2, **timed))
        if r and a:
            await self._one(f"{k}-s", self._job(SHORT, after=[f"{r}:ok", f"{a}:ok"], **timed))
        if c:
            await self.array(f"{k}-x", self._job(ARRAY_SECONDS, after=[f"{c}:ok"], **timed), 6, 2)
        await self.array(f"{k}-y", self._job(ARRAY_SECONDS, **timed), 6, 3)
        ckpt = self._job(CHECKPOINT_SECONDS, checkpoint=True, checkpoint_every=0.3)
        if (kk := await self._one(f"{k}-k", ckpt)) is not None:
            self.cluster.requeueable.add(kk)
        gpu = {"queue": GPU_QUEUE, "wait_for_worker": True}
        filling = [await self._one(f"{k}-g{i}", {**ckpt, **gpu, "gpus": 1}) for i in range(4)]
        # The job with a priority once they all run: sent sooner, on a loaded machine it took a
        # GPU not yet filled, ahead of them, and nothing was preempted.
        await self._until_running([job for job in filling if job], FILL_SECONDS)
        await self._one(f"{k}-p", self._job(SHORT, priority=5, gpus=1, **gpu))
        for i in range(2):
            await self._one(f"{k}-m{i}", self._job(SHORT * 2, gpu_mem=30 * GIB, **gpu))

    async def _until_running(self, jobs: list[str], seconds: float) -> None:
        """Wait until every one of `jobs` runs, `seconds` at most (a fault may keep one back: the
        unit goes on regardless)."""
        deadline = time.monotonic() + seconds
        with contextlib.suppress(Exception):  # (Redis at fault: the unit goes on)
            async with self.cluster.queue() as queue:
                while time.monotonic() < deadline:
                    states = [(await queue.get(job)).state for job in jobs]
                    if all(state is JobState.RUNNING for state in states):
                        return
                    await asyncio.sleep(0.1)

    async def array(self, key: str, base: dict[str, Any], size: int, window: int) -> None:
        """An array of `size` jobs, at most `window` under way, sent in one batch as poolctl
        sends `--array 0-{size-1}%{window}`."""
        array_id, specs = array_specs(base, list(range(size)), [], window)
        ids = await self._batch(array_id, specs)
        if ids is None:
            self.done.refused[key] = [d.rpartition(":")[0] for d in base.get("after", [])]
            self.cluster.faults.note(f"array {key} refused")
            return
        self.done.arrays[array_id] = ids
        for job_id in ids:
            self.submitter.acked.setdefault(job_id, time.time())

    async def _batch(self, array_id: str, specs: list[dict[str, Any]]) -> list[str] | None:
        """Send the batch until it is answered; after a failure once sent, the array's jobs if
        the pool has them (one script wrote them all, or none). None when refused."""
        for _ in range(200):
            client = self.cluster.client()
            try:
                await client.connect()
                return (await client.call(EnqueueBatch(specs), EnqueuedBatch)).job_ids
            except ClientError as exc:
                if exc.code in FINAL:
                    return None
                if exc.sent and (ids := await self._array_jobs(array_id)):
                    return ids
            finally:
                with contextlib.suppress(Exception):
                    await client.close()
            await asyncio.sleep(0.1)
        raise AssertionError(f"could not submit array {array_id} in 200 tries")

    async def _array_jobs(self, array_id: str) -> list[str]:
        """The array's jobs the pool has ([] when none), asked until the pool answers."""
        for _ in range(200):
            client = self.cluster.client()
            try:
                await client.connect()
                detail = await client.call(ShowJob(array_id), JobDetail)
                return [str(i) for i in detail.job["array"]["ids"]]
            except ClientError as exc:
                if exc.code == ErrorCode.NOT_FOUND:
                    return []
            finally:
                with contextlib.suppress(Exception):
                    await client.close()
            await asyncio.sleep(0.1)
        raise AssertionError(f"could not look up array {array_id} in 200 tries")
