"""The worker the server runs for an agent (docs/PROTOCOL.md §3.4): a real `Worker` whose jobs run
on the agent's machine, while every fenced write (claims, renewals, heartbeats, outcomes, log
chunks, checkpoint records) is made here, by the server's code with the server's Redis
credentials, as a worker makes them on its own machine.

`HostedWorker` differs from a worker on its own machine in three things only. Its slots are the
agent's: nothing of the server's machine is opened for them (no directory, uid, cgroup, spawner or
orphan guard: slots.py, `local=False`). Its `make_run` is a `RemoteRun`, the Run protocol
(run_types.py) as `agent_order` items of the agent's `serve_jobs` stream, told how the attempt went by
the agent's calls (`exited`, `ended`, `tidied`). And its JobQueue is a view of its own on the
server's Redis client: the read cursors and the standing claim of one worker's wait for work are
kept per JobQueue, and the view's claims take only the agent's user's jobs (`serve_user`), unless
that user is a pool admin, whose agent serves everyone. (A standing claim on the view is never sent
by an enqueue, which goes through the server's own JobQueue: the view's blocking read wakes it.)

The agent's connection, and its beats, are the worker's life. The agent calls `beat` every
`beat_seconds` (the hello says it: the heartbeat's interval); the answer says how long each lease
it runs surely holds, counted from when the beat came (its deadline, attempt.py, which keeps the
worker's margin, less now), and the agent counts that from when it sent the beat, which is before.
When the connection ends, or no beat has come for the lease less the heartbeat's margin (a frozen
agent, a dead node, a partition: TCP may not say so for many minutes), the worker abandons itself
(`abandon`): every RemoteRun ends LOST at once, nothing is recorded or handed back for what the
agent ran, and those leases lapse for the reaper to reclaim, as a dead worker's do. Until then it
never renews a lease past its last beat plus that window. By then the agent has killed those
jobs: it kills all it runs when its connection ends, each whose deadline passes with no beat
answered to move it, and all of them once no beat has been answered for a lease.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from daemon.config import HAND_BACK_SECONDS, Config
from daemon.errors import GpupoolError
from daemon.job import JobState, Lease, Outcome
from daemon.object_store import artifact_prefix
from daemon.queue import registry
from daemon.queue.job_queue import JobQueue
from daemon.worker.attempt import boottime
from daemon.worker.dispatcher import Worker
from daemon.worker.gpus import GpuInfo
from daemon.worker.lifetime import Lifetime
from daemon.worker.run_types import Ending, RunResult
from protocol import AgentOrder, ErrorCode, ServeJobs

log = logging.getLogger(__name__)

KEY_BYTES = 32  # the key every agent_call of the agent carries (hello)
# Beyond kill_grace, how long a RemoteRun waits for the agent's `tidied` before it takes the slot
# as ready (an agent that stopped answering is abandoned for want of beats well before).
TIDY_SLACK = 10.0
# How long a run ordered lost waits for the agent's `ended` before it is taken as over: the
# agent kills at once, so only an agent that stopped answering takes this long.
LOSE_WAIT = 10.0

Order = Callable[[str, str, dict[str, Any]], None]  # (act, lease id, detail): one agent_order


class RemotePhase(enum.Enum):
    """Where a RemoteRun is; it only moves down this list."""

    NEW = "new"  # not ordered yet (one lost now goes straight to DONE)
    RUNNING = "running"  # `run` sent: the agent's calls for it are taken until its `ended`
    ENDED = "ended"  # the agent said how it ended (or was taken to have: gone, or lost)
    TIDYING = "tidying"  # `tidy` sent: its `tidied` is awaited
    DONE = "done"


def invalid(what: str) -> GpupoolError:
    return GpupoolError(what, ErrorCode.INVALID_ARGUMENT)


def lease_map(lease: Lease) -> dict[str, Any]:
    """The attempt's lease as a `run` order carries it."""
    return {
        "job_id": lease.job_id,
        "attempt": lease.attempt,
        "worker": lease.worker,
        "spec": lease.spec.to_dict(),
        "id": lease.id,
        "shared_gpu": lease.shared_gpu,
        "ahead": lease.ahead,
    }


def run_result(args: Mapping[str, Any], gpus: tuple[GpuInfo, ...], lease: Lease) -> RunResult:
    """What an `ended` call says, as the worker records it (INVALID_ARGUMENT for a call that
    does not say it well): an ending, an outcome exactly where the ending has one, the attempt's
    own GPUs left dirty, the signal that killed it."""
    try:
        ending = Ending(str(args.get("ending")))
    except ValueError:
        raise invalid(f"ending must be one of {', '.join(e.value for e in Ending)}") from None
    outcome = None
    if ending in (Ending.HANDED_BACK, Ending.LOST):
        if args.get("outcome") is not None:
            raise invalid(f"an attempt {ending.value} has no outcome: send outcome nil")
    else:
        given = args.get("outcome")
        if not isinstance(given, Mapping):
            raise invalid(
                f"an attempt that {ending.value} needs its outcome (state, exit_code, detail, result)"
            )
        try:
            outcome = Outcome(
                JobState(str(given.get("state"))),
                _optional_int(given.get("exit_code"), "outcome exit_code"),
                str(given.get("detail") or ""),
                # gpu_usage is the worker's own reading of NVML; an agent reads none, and its
                # word on it would reach accounting as measured (docs/OPERATIONS.md)
                {k: v for k, v in dict(given.get("result") or {}).items() if k != "gpu_usage"},
            )
        except (ValueError, TypeError):
            raise invalid("outcome state must be succeeded, failed or cancelled, result a map") from None
        check_outcome(outcome, lease)
    dirty = args.get("dirty_gpus") or {}
    if not isinstance(dirty, Mapping):
        raise invalid("dirty_gpus must map GPU uuids to why")
    own = {g.uuid for g in gpus}  # an attempt speaks for its own GPUs only
    dirty_gpus = {str(uuid): str(why) for uuid, why in dirty.items() if uuid in own}
    return RunResult(ending, outcome, dirty_gpus, _optional_int(args.get("killed_by"), "killed_by"))


# What an agent's outcome may carry (a worker's own keeps within these: a short sentence, a
# result of a tail of output and the list of its artifacts): Redis keeps it for job_retention.
MAX_DETAIL = 4096
MAX_RESULT_BYTES = 1 << 20


def check_outcome(outcome: Outcome, lease: Lease) -> None:
    """An outcome within the bounds a worker's keeps to, whose artifacts (and log copy) lie under
    the attempt's own prefix; else INVALID_ARGUMENT, nothing recorded."""
    if len(outcome.detail) > MAX_DETAIL:
        raise invalid(f"an outcome's detail is a sentence: at most {MAX_DETAIL} characters")
    if len(orjson.dumps(outcome.result, default=str)) > MAX_RESULT_BYTES:
        raise invalid(
            f"an outcome's result takes at most {MAX_RESULT_BYTES >> 10} KiB (its artifacts listed)"
        )
    own = artifact_prefix(lease.job_id, lease.id)
    described = [*(outcome.result.get("artifacts") or []), outcome.result.get("log") or {"key": own}]
    if not all(isinstance(a, Mapping) and str(a.get("key", "")).startswith(own) for a in described):
        raise invalid(f"an outcome names artifacts under its own attempt's prefix only ({own})")


def _optional_int(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(f"{what} must be an integer or nil")
    return value


class RemoteRun:
    """One attempt run by the agent (the Run protocol, run_types.py). `start` orders it run;
    `cancel`, `hand_back` and `lose` order it stopped; `run` returns what the agent's `ended`
    said: LOST once the agent is gone (`gone`), or LOSE_WAIT after `lose` with no word from it."""

    def __init__(
        self,
        order: Order,
        lease: Lease,
        gpus: tuple[GpuInfo, ...],
        slot: int,
        valid_for: Callable[[], float],
        *,
        kill_grace: float = 10.0,
    ) -> None:
        """`order` sends an agent_order; `valid_for` says how long the lease surely holds now;
        `kill_grace` bounds, with TIDY_SLACK, the wait for `tidied`."""
        self.lease = lease
        self.gpus = gpus
        self.slot = slot
        self.phase = RemotePhase.NEW
        self._order = order
        self._valid_for = valid_for
        self._tidy_wait = kill_grace + TIDY_SLACK
        self._exited = False
        self._stop_ordered = False  # a cancel, hand-back or loss was ordered (`stopping`)
        self._result: asyncio.Future[RunResult] = asyncio.get_running_loop().create_future()
        self._tidied = asyncio.Event()

    @property
    def exited(self) -> bool:
        return self._exited

    @property
    def stopping(self) -> bool:
        return self._stop_ordered or self._exited

    def start(self) -> None:
        if self.phase is not RemotePhase.NEW or self._result.done():
            return  # lost before it started (its claim came too late, or the agent is gone)
        self.phase = RemotePhase.RUNNING
        detail = {
            "lease": lease_map(self.lease),
            "gpus": [g.uuid for g in self.gpus],
            "slot": self.slot,
            "valid_for": self._valid_for(),
        }
        self._order("run", self.lease.id, detail)

    async def run(self) -> RunResult:
        if self.phase is RemotePhase.NEW:
            self._settle(RunResult(Ending.LOST, None))  # never ordered: nothing ran
        return await asyncio.shield(self._result)

    async def tidy(self) -> None:
        """Order the slot made ready for its next job, and wait until the agent says it is (or is
        gone), or at most kill_grace + TIDY_SLACK, then takes it as ready all the same: a slot is
        the agent's, and a worker must not wait for ever on a peer. An attempt never ordered run
        left nothing to tidy."""
        if self.phase is not RemotePhase.ENDED:
            return
        self.phase = RemotePhase.TIDYING
        self._order("tidy", self.lease.id, {})
        try:
            async with asyncio.timeout(self._tidy_wait):
                await self._tidied.wait()
        except TimeoutError:
            log.warning(
                "job %s: the agent did not say its slot %d was tidied in %g s; taking it as ready",
                self.lease.job_id,
                self.slot,
                self._tidy_wait,
            )
        self.phase = RemotePhase.DONE

    def cancel(self) -> None:
        self._stop("cancel", {})

    def hand_back(
        self, now: bool = False, why: str = "the worker is stopping", by_policy: bool = False
    ) -> None:
        del by_policy  # (an agent's GPUs are not watched by the pool's GPU policies)
        self._stop("hand_back", {"now": now, "why": why})

    def note(self, text: str) -> None:
        """The agent writes the job's log; a note of this side's is the worker's log line only."""
        log.info("job %s: %s", self.lease.job_id, text)

    def lose(self, why: str) -> None:
        """As JobRun's: killed now, nothing recorded; once its process has ended, no change."""
        if self.phase is RemotePhase.NEW:
            self._settle(RunResult(Ending.LOST, None))
        elif self.phase is RemotePhase.RUNNING and not self._exited:
            self._stop("lose", {"why": why})
            lost = RunResult(Ending.LOST, None)
            asyncio.get_running_loop().call_later(LOSE_WAIT, self._settle, lost)

    def _stop(self, act: str, detail: dict[str, Any]) -> None:
        if self.phase is RemotePhase.RUNNING:
            self._stop_ordered = True
            self._order(act, self.lease.id, detail)

    def _settle(self, result: RunResult) -> None:
        if not self._result.done():
            self._result.set_result(result)
        if self.phase is RemotePhase.NEW:
            self.phase = RemotePhase.DONE  # never ordered run: nothing to tidy
        elif self.phase is RemotePhase.RUNNING:
            self.phase = RemotePhase.ENDED

    # -- what the agent tells (agent_call) -------------------------------------------------------

    def told(self, call: str, args: Mapping[str, Any]) -> None:
        """The agent's `exited`, `ended` or `tidied` for this attempt (`accepts` said it may)."""
        if call == "exited":
            self._exited = True
        elif call == "ended":
            self._settle(run_result(args, self.gpus, self.lease))
        elif call == "tidied":
            self._tidied.set()

    def accepts(self, call: str) -> bool:
        """Whether the agent may make `call` for this attempt now: any while it runs (`run`
        sent, `ended` not yet answered); `tidied` once `tidy` is sent."""
        if call == "tidied":
            return self.phase is RemotePhase.TIDYING
        return self.phase is RemotePhase.RUNNING

    def gone(self) -> None:
        """The agent's connection ended: the attempt is lost (its lease lapses), nothing waits."""
        self._settle(RunResult(Ending.LOST, None))
        self.phase = RemotePhase.DONE
        self._tidied.set()


class HostedWorker(Worker):
    """A Worker for the agent that offered its machine with `offer` (see the module doc). The
    server streams `next_order()` to the agent until it returns None (the worker has stopped);
    `attempt(lease_id, call)` is the RemoteRun that may take the agent's call; `beat` and `drain`
    are its `beat` and `drain` calls; `abandon` is its connection's end (or its beats')."""

    def __init__(
        self,
        queue: JobQueue,
        offer: ServeJobs,
        *,
        data_dir: Path,
        heartbeat_seconds: float = 30.0,
        drain_timeout: float = 60.0,
        kill_grace: float = 10.0,
        gpu_max_jobs: int = 4,
        lifetime: Lifetime | None = None,
    ) -> None:
        """`queue`: a view of the pool's queue of this worker's own (the module doc says why);
        `data_dir` is never written (nothing of this machine is used for the slots)."""
        self.key = secrets.token_bytes(KEY_BYTES)
        self.why = ""  # why it stopped, for the agent's `served`
        self._orders: asyncio.Queue[AgentOrder | None] = asyncio.Queue()
        self._remote: dict[str, RemoteRun] = {}  # by lease id, from its run to its tidying
        self._gone = False
        self._due: asyncio.Task[None] | None = None  # the wait for its lifetime's end
        self._stopper: asyncio.Task[None] | None = None  # stop(), when it leaves by itself
        self._beats: asyncio.Task[None] | None = None  # the watch on the agent's beats
        self._last_beat = boottime()  # the hello counts as one
        gpus = [
            GpuInfo(int(g["index"]), str(g["uuid"]), str(g["name"]), int(g["memory"])) for g in offer.gpus
        ]
        super().__init__(
            queue,
            data_dir=data_dir,
            slots=offer.slots,
            queues=offer.queues,
            heartbeat_seconds=heartbeat_seconds,
            drain_timeout=drain_timeout,
            kill_grace=kill_grace,
            gpus=gpus,
            worker_id=registry.agent_worker_id(offer.host),
            env={},  # nothing of the server's environment: the agent's jobs get the agent's
            make_run=self._remote_run,
            gpu_max_jobs=gpu_max_jobs,
            lifetime=lifetime,
            local=False,
        )
        self._registration.host = offer.host
        for key, value in offer.machine.items():  # checked by the server (agents.check_offer)
            setattr(self._registration, key, value)
        # The agent beats at the heartbeat's pace; a beat missing for the lease less the heartbeat's
        # margin ends the worker (`_watch_beats`), and no renewal goes past that either.
        self.beat_seconds = min(self.heartbeat.interval, self.heartbeat.lease / 3)
        self.beat_window = self.heartbeat.lease - self.heartbeat.margin
        hello = {"worker": self.id, "key": self.key, "lease_seconds": self.heartbeat.lease}
        self._order("hello", "", hello | {"kill_grace": kill_grace, "beat_seconds": self.beat_seconds})

    # -- the agent's stream ------------------------------------------------------------------------

    def _order(self, act: str, lease_id: str, detail: dict[str, Any]) -> None:
        if not self._gone:
            self._orders.put_nowait(AgentOrder(act, lease_id, detail))

    async def next_order(self) -> AgentOrder | None:
        """The next order for the agent, in the order they were made; None once the worker has
        stopped (the stream's end)."""
        return await self._orders.get()

    def attempt(self, lease_id: str, call: str) -> RemoteRun | None:
        """The attempt `lease_id` if the agent may make `call` for it now, else None."""
        run = self._remote.get(lease_id)
        return run if run is not None and run.accepts(call) else None

    def _remote_run(self, lease: Lease, gpus: tuple[GpuInfo, ...], slot: int) -> RemoteRun:
        held = self._held.get(lease.id)  # (held from just before this: dispatcher._launch)
        deadline = held.deadline if held is not None else boottime()
        valid_for = lambda: max(0.0, deadline - boottime())  # noqa: E731 - read at the run order
        run = RemoteRun(self._order, lease, gpus, slot, valid_for, kill_grace=self.kill_grace)
        if self._gone:
            run.gone()
        else:
            # (those done are let go here: the map holds what the slots and look-ahead hold)
            self._remote = {i: r for i, r in self._remote.items() if r.phase is not RemotePhase.DONE}
            self._remote[lease.id] = run
        return run

    # -- the agent's beats, and the heartbeat's target ------------------------------------------------

    def beat(self) -> dict[str, float]:
        """The agent's `beat` call: it is alive now. How long each attempt it runs surely holds its
        lease from now (deadline less now; 0 once passed), every one ordered run and not ended:
        those being cancelled or handed back too (their stop takes a while)."""
        self._last_beat = now = boottime()
        return {
            lease_id: max(0.0, held.deadline - now)
            for lease_id, run in self._remote.items()
            if run.phase is RemotePhase.RUNNING and (held := self._held.get(lease_id)) is not None
        }

    def _silent_for(self) -> float:
        return boottime() - self._last_beat

    def leases(self) -> Sequence[Lease]:
        """As a worker's, but none once the agent has not beaten for the window: a lease is never
        renewed past the last beat plus the window, for what the agent runs may be dead, or may
        run on unchecked after a partition."""
        return [] if self._silent_for() > self.beat_window else super().leases()

    async def _watch_beats(self) -> None:
        """Abandon the worker once no beat has come for the window, as if the connection ended:
        looked at every heartbeat interval."""
        while True:
            if (silent := self._silent_for()) > self.beat_window:
                break
            await asyncio.sleep(min(self.beat_seconds, self.beat_window - silent + 0.01))
        why = f"no beat from the agent for {silent:.1f} s (its lease is {self.heartbeat.lease:g} s)"
        log.warning("agent worker %s: %s; abandoning its jobs to lapse", self.id, why)
        self._stopper = asyncio.create_task(self.abandon(why), name=f"abandon {self.id}")

    # -- life cycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await super().start()  # on failure nothing of the worker runs: its view goes too
        except BaseException:
            await self.queue.close()
            raise
        self._last_beat = boottime()
        self._beats = asyncio.create_task(self._watch_beats(), name=f"beats of {self.id}")
        if self.lifetime is not None:
            self._due = asyncio.create_task(self._leave_when_due(self.lifetime), name=f"lifetime {self.id}")

    async def _leave_when_due(self, lifetime: Lifetime) -> None:
        self.leave(await lifetime.due(self.idle_for))

    def leave(self, why: str) -> None:
        """Stop as SIGTERM stops a worker (stop(): drain, then hand back), saying `why`."""
        self.why = self.why or why
        if self._stopper is None and not self.draining():
            self._stopper = asyncio.create_task(self.stop(), name=f"stop {self.id}")

    def drain(self, now: bool) -> None:
        """The agent's `drain` call: as its first SIGTERM, or with `now` its second."""
        if now:
            self.force()
        self.leave("drained at the agent's request")

    async def stop(self, drain_timeout: float | None = None) -> None:
        try:
            await super().stop(drain_timeout)
        finally:
            if self._stopped.is_set():  # (not where a second call's wait was cancelled)
                for task in (self._due, self._beats):
                    if task is not None:
                        task.cancel()
                await self.queue.close()  # its view of the pool's queue is done with
                self._orders.put_nowait(None)  # the stream ends

    async def abandon(self, why: str) -> None:
        """The agent's connection ended: every attempt it ran is lost, nothing is handed back
        for them (their leases lapse), and the worker stops at once."""
        self.why = self.why or why
        self._gone = True
        for run in self._remote.values():
            run.gone()
        self._remote.clear()
        self.force()
        await self.stop(drain_timeout=0)


def hosted_worker(queue: JobQueue, config: Config, offer: ServeJobs, serve_user: str) -> HostedWorker:
    """The worker for an agent's `offer`, on a view of the server's `queue` whose claims take only
    `serve_user`'s jobs ("": everyone's, for an admin's agent), with the configuration's timings.
    An offer whose `leave_by` leaves no time to work is refused (INVALID_ARGUMENT)."""
    view = JobQueue.from_config(queue.redis, config, watch=queue.watch)
    view.serve_user = serve_user
    # The agent's own timings where shorter: a pilot reckons its lifetime with them.
    drain = min(config.drain_timeout, max(0.0, offer.drain_timeout))
    grace = min(config.kill_grace, max(0.0, offer.kill_grace))
    lifetime = None
    if offer.leave_by:
        now = time.time()
        lifetime = Lifetime(0.0, offer.leave_by - now, drain, grace, now)
        if lifetime.max_lifetime <= (leaving := drain + grace + HAND_BACK_SECONDS):
            raise invalid(
                f"leave_by is {lifetime.max_lifetime:.0f} s from now, and this agent's worker takes "
                f"{leaving:g} s to leave (drain_timeout + kill_grace + hand-back, the shorter of the "
                "agent's and the server's): offer the machine while it has longer to live, or with "
                "leave_by 0 (no end)"
            )
    return HostedWorker(
        view,
        offer,
        data_dir=config.data_path() / "agents",
        heartbeat_seconds=config.heartbeat_seconds,
        drain_timeout=drain,
        kill_grace=grace,
        gpu_max_jobs=config.gpu_max_jobs,
        lifetime=lifetime,
    )
