"""An attempt's own calls: what the worker that holds a lease says of its attempt, from its
heartbeat (`renew`) to its end (`complete`, `hand_back`), with what it records between (started,
a checkpoint, idle GPUs, its log). Each is one Lua script fenced by the lease (worker, attempt,
lease id): a call from an attempt that is no longer the job's current one changes nothing.

`AttemptCalls` is a mixin of JobQueue, apart because these are the worker's side of a job once
claimed, which a reader looks for together: the queue's other writes (submit, cancel, requeue,
reclaim) are the pool's and its users'.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import orjson
from redis.commands.core import AsyncScript

from daemon.errors import StaleAttempt
from daemon.job import JobState, Lease, Outcome, RenewStatus
from daemon.queue import keys
from daemon.queue.reads import _s

if TYPE_CHECKING:
    from daemon.queue.scripts import Calls, ScriptBatch, Scripts


def _raise_if_stale(lease: Lease, reply: Sequence[Any]) -> None:
    """A fenced script's `{'stale', state, attempt}` answer: the attempt is no longer current."""
    if reply[0] == b"stale":
        raise StaleAttempt(
            lease.job_id, lease.attempt, f"the job is {_s(reply[1])} at attempt {_s(reply[2])}"
        )


def _gpu_util(usage: object) -> str:
    """The attempt's mean GPU utilisation in percent, from the usage summary its worker measured
    (`gpu_usage`'s `efficiency`, 0 to 1: in an outcome's result, or given with a hand-back), for
    its accounting record; "" where none was measured."""
    efficiency = usage.get("efficiency") if isinstance(usage, Mapping) else None
    if isinstance(efficiency, int | float) and not isinstance(efficiency, bool) and 0 <= efficiency <= 1:
        return f"{efficiency * 100:.2f}"
    return ""


class AttemptCalls:
    """The calls of a JobQueue fenced by an attempt's lease (JobQueue sets these attributes)."""

    scripts: Scripts
    _call: Calls
    lease_ms: int
    retention: int
    accounting_days: int
    backoff_ms: tuple[int, ...]
    log_head: int
    log_tail: int

    def batch(self, *, ack: bool = True) -> ScriptBatch:
        raise NotImplementedError  # JobQueue's

    async def renew(self, worker: str, leases: Iterable[Lease]) -> dict[str, RenewStatus]:
        """Extend all of a worker's leases in one round trip (one script call per queue, pipelined).
        The answers are keyed by lease id. A lease that was reclaimed answers LOST and is not
        taken back."""
        batch = self.batch(ack=False)
        answers = self.add_renewals(batch, worker, leases)
        return answers(await batch.execute())

    def add_renewals(
        self, batch: ScriptBatch, worker: str, leases: Iterable[Lease]
    ) -> Callable[[Sequence[Any]], dict[str, RenewStatus]]:
        """Add the renewals of `renew` to `batch` (so a heartbeat can send them in the same round
        trip as other calls); returns the function that reads their answers, by lease id, from the
        batch's replies once it has run. Answers are keyed by lease, never by job: an answer
        for one attempt can never be taken for another attempt of the same job."""
        by_queue: dict[str, list[Lease]] = {}
        for lease in leases:
            by_queue.setdefault(lease.queue, []).append(lease)
        calls: list[tuple[int, list[Lease]]] = []
        for q, held in by_queue.items():
            args: list[Any] = [keys.queue_prefix(q), worker, self.lease_ms]
            for lease in held:
                args += [lease.job_id, lease.attempt, lease.id]
            # durable: a lease is held only as far as a replica has its renewal (see `claim_many`)
            calls.append((batch.add(self.scripts.renew, [keys.leases(q)], args, durable=True), held))

        def answers(replies: Sequence[Any]) -> dict[str, RenewStatus]:
            out: dict[str, RenewStatus] = {}
            for index, held in calls:
                for lease, answer in zip(held, replies[index], strict=True):
                    out[lease.id] = RenewStatus(_s(answer))
            return out

        return answers

    def mark_started(self, lease: Lease, *, linger: float = 0.0) -> asyncio.Future[Any]:
        """Say that an attempt claimed ahead of a free slot (`lease.ahead`) has started
        (started.lua): from now a reclaim counts it as run, and fair share bills it. Queued for
        this turn's batch (with the outcome of the job whose slot it took, say; `linger` as
        `complete`'s); the future answers 1 when it marked the attempt now, 0 when there was
        nothing to mark (not claimed ahead, or no longer this lease's)."""
        return self._call.submit(
            self.scripts.started,
            [keys.job(lease.job_id)],
            [lease.worker, lease.attempt, lease.id],
            linger=linger,
        )

    async def record_checkpoint(self, lease: Lease, name: str) -> bool:
        """Record the complete save `name` (checkpoints.py) as the one the job's next attempt
        restores (checkpoint.lua): False, recording nothing, when the attempt no longer holds the
        job (its lease taken back or expired)."""
        answer = await self._call(
            self.scripts.checkpoint,
            [keys.job(lease.job_id), keys.leases(lease.queue)],
            [lease.worker, lease.attempt, lease.id, name],
        )
        return bool(answer)

    async def flag_idle_gpu(self, lease: Lease, record: Mapping[str, Any]) -> bool:
        """Record on the job that this attempt leaves its GPUs idle (`idle_gpu` in its record,
        idle_gpu.lua): False, recording nothing, when the attempt no longer holds the job."""
        answer = await self._call(
            self.scripts.idle_gpu,
            [keys.job(lease.job_id)],
            [lease.worker, lease.attempt, lease.id, orjson.dumps(dict(record))],
        )
        return bool(answer)

    async def append_log(self, lease: Lease, number: int, chunks: Sequence[bytes]) -> None:
        """Append output of an attempt to its job's log, as the attempt's call `number` (1, 2, ...:
        a call sent again with its number is written once). Raises StaleAttempt, writing nothing,
        when the attempt is no longer current."""
        answer = await self._call(
            self.scripts.log,
            [keys.job(lease.job_id), keys.log(lease.job_id)],
            [lease.worker, lease.attempt, lease.id, number, self.log_head, self.log_tail, *chunks],
        )
        if answer == b"stale":
            raise StaleAttempt(lease.job_id, lease.attempt, "its log is closed to it")

    async def complete(self, lease: Lease, outcome: Outcome, *, linger: float = 0.0) -> JobState:
        """Record how an attempt ended. Returns the job's state afterwards (QUEUED when a failed job
        goes back for a retry). Raises StaleAttempt, changing nothing, when `lease` is no longer the
        job's current one (it was reclaimed, or ended otherwise). The same call made again (its
        reply was lost) answers as the first did. `linger`: seconds the call may wait for others
        to travel with (fast_path.Pipeliner)."""
        q = lease.queue
        return await self._end_attempt(
            self.scripts.complete,
            lease,
            [keys.stream(q), keys.leases(q), keys.events(q), keys.front(q)],
            str(outcome.state),
            "" if outcome.exit_code is None else outcome.exit_code,
            outcome.detail,
            msgpack.packb(dict(outcome.result)),
            self.retention,
            *self.backoff_ms,
            self.accounting_days,
            _gpu_util(outcome.result.get("gpu_usage")),
            durable=True,
            linger=linger,
        )

    async def hand_back(
        self,
        lease: Lease,
        *,
        by_policy: bool = False,
        gpu_usage: Mapping[str, Any] | None = None,
        why: str = "",
    ) -> JobState:
        """Hand an attempt back that this worker stopped before its job finished (a drain): the job
        goes to the front of its queue and is claimed next with attempt+1; a hand-back does not
        count towards max_attempts, unless the pool's GPU policies made it (`by_policy`: idle
        GPUs, a GPU fault), when it is a loss and the job is DEAD at max_attempts. `gpu_usage`:
        the attempt's GPU usage summary, where its worker measured one: its efficiency goes into
        the job's accounting as a completed attempt's does. `why`: what the policies saw, the
        job's detail until an end of its own sets another (its next attempt runs with it, as
        after a failed retry), and named in a dead one's. Returns QUEUED, DEAD, or CANCELLED
        when the user cancelled it meanwhile. Raises StaleAttempt, changing nothing, when `lease`
        is no longer current."""
        q = lease.queue
        return await self._end_attempt(
            self.scripts.hand_back,
            lease,
            [keys.stream(q), keys.front(q), keys.leases(q), keys.events(q)],
            self.retention,
            self.accounting_days,
            "1" if by_policy else "",
            _gpu_util(gpu_usage),
            why if by_policy else "",
        )

    async def _end_attempt(
        self,
        script: AsyncScript,
        lease: Lease,
        job_keys: list[str],
        *args: Any,
        durable: bool = False,
        linger: float = 0.0,
    ) -> JobState:
        """Run a script that ends `lease`'s attempt (complete.lua, hand_back.lua), fenced by the lease:
        the job's state afterwards, or StaleAttempt when the lease is no longer current. `durable`:
        acknowledged once on the replicas asked for (an outcome; a hand-back need not be: lost
        with a primary, the attempt's lease expires and the job runs again)."""
        reply = await self._call(
            script,
            job_keys,
            [
                keys.queue_prefix(lease.queue),
                keys.GROUP,
                lease.worker,
                lease.job_id,
                lease.attempt,
                lease.id,
                *args,
            ],
            durable=durable,
            linger=linger,
        )
        _raise_if_stale(lease, reply)
        return JobState(_s(reply[0]))
