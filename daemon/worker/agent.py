"""An agent worker: this machine's slots, run for a worker the pool server runs (docs/PROTOCOL.md §3.4).

`poold --worker` with `worker_via_server` runs an `Agent` instead of a Worker. It holds no Redis or
S3 credential, only its user's token (`worker_token_file`): a job that reads whatever the agent
can read acts at most as that user already may. So an agent whose jobs run as its own uid (it is
not root, or has no slot uids) runs its own user's jobs only, an admin's included: it says so in
its offer (`shared_uid`), and the server sends it no other user's; should one come all the same,
it hands the job back untouched and leaves, saying why.

It offers its slots and GPUs with `serve_jobs`; the server runs a real Worker for it
(daemon/worker/hosted.py), which claims, renews, heartbeats and records every end, and streams
orders: `run` an attempt on a slot with some GPUs, `cancel`, `hand_back` or `lose` it, and `tidy`
its slot. The agent calls `beat` every `beat_seconds` (the hello says it; agent_beats.py): that
keeps the server's worker alive, and its answer says how long each lease still holds.

Each `run` is a real `runner.JobRun` on this machine's `slots.Slots` (scratch directories, slot
uids when root, cgroups, the spawner, the orphan guard), whose pool is the attempt's
`relay.Relay` (its log and checkpoint records go through the server) and whose object store is a
`ticket_store.TicketStore` (transfers the server signs for that attempt's keys only). Its news
goes back by `agent_call`: `exited` when its first process ends, `ended` with how it ended (the
server records it), `tidied` when its slot is ready again.

Fences, as a worker's own (attempt.py): each attempt holds its lease until a deadline, set by the
`run` order's `valid_for` (provisional: counted from when the order came; the agent beats at once)
and moved by each answered `beat`, whose seconds the server counts from when the beat came, and
the agent from when it sent it, which is before: sound whatever the delays. The fence kills an
attempt whose deadline passes, and the orphan guard holds the same deadlines, should the agent be
frozen. A beat unanswered in `beat_seconds` failed; once no beat has been answered for a lease the
agent ends its serve, as when the connection to the server ends: every job is killed at once (the
server's worker for this agent has ended too, or soon will, and the leases lapse and go back to
their queues, as a dead worker's do). Every call has a bound, so a half-open connection never
holds the agent.

Stopping (main.py drives it as a worker): `stop()` asks the server's worker to drain (`drain`
{now: false}), which stops taking jobs and lets the running ones finish, then, after the agent's
own `drain_timeout`, to stop them now (`drain` {now: true}), which hands them back by `hand_back`
orders, as a worker's two-phase stop does; `force()` (a second SIGTERM) asks for that at once.
The agent leaves when `served` ends the stream, or after a bounded wait, killing what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from daemon.aio import TaskSet, cancel_and_wait, start_or_undo
from daemon.client.pool_client import ClientError, PoolClient
from daemon.config import make_data_dir
from daemon.errors import GpupoolError
from daemon.git import NETWORK_PROTOCOLS
from daemon.job import JobSpec, Lease
from daemon.queue import registry
from daemon.worker import non_root
from daemon.worker.agent_beats import Beats
from daemon.worker.attempt import HeldAttempt, Holdings, Phase, boottime
from daemon.worker.confine import Confinement
from daemon.worker.env_build import EnvSettings
from daemon.worker.envs import EnvCache
from daemon.worker.gpus import GpuInfo, GpuProbe, Nvml
from daemon.worker.identity import SlotIdentity
from daemon.worker.lifetime import Lifetime
from daemon.worker.nvml_life import close_within, discover_within
from daemon.worker.pool_link import PoolUnreachable
from daemon.worker.relay import AgentCalls, Relay
from daemon.worker.run_types import Ending, RunResult, passed_env
from daemon.worker.runner import JobRun
from daemon.worker.slots import Slots
from daemon.worker.ticket_store import TicketStore
from protocol import AgentOrder, Served, ServeJobs
from storage.cache import ObjectCache

log = logging.getLogger(__name__)

HELLO_SECONDS = 30.0  # how long the server has to say hello once serve_jobs is sent
SERVED_MARGIN = 30.0  # beyond kill_grace, how long an agent that asked for its jobs' stop waits for `served`
LOST_SECONDS = 10.0  # how long killed jobs have to end before the agent closes their slots
DRAIN_CALL_SECONDS = 5.0  # how long a `drain` call may take to be answered
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=300)


class AgentError(GpupoolError):
    """An agent cannot start as configured; the sentence says what to set."""


class Agent:
    """This machine's slots, run for the server's worker over `client` (module docstring):
    `start()`, then `stop()` (safe twice), `force()` during a stop. `ended` is set when the serve is
    over by itself (`served`, or the connection lost), `leaving` then, or when its lifetime says it
    must go: its owner then stops it.

    Seams, as Worker's: `gpus` (None: discovered with NVML), `identities` (one uid per slot; None:
    the agent's own), `env` (the base of every job's environment; default: this process's)."""

    def __init__(
        self,
        client: PoolClient,
        *,
        data_dir: Path,
        slots: int = 2,
        queues: Sequence[str] = ("default",),
        drain_timeout: float = 60.0,
        kill_grace: float = 10.0,
        job_nice: int = 0,
        job_network: str = "host",
        gpus: Sequence[GpuInfo] | None = None,
        identities: Sequence[SlotIdentity] | None = None,
        env: Mapping[str, str] | None = None,
        cache_bytes: int = 50 * 1024**3,
        git_protocols: str = NETWORK_PROTOCOLS,
        lifetime: Lifetime | None = None,
        host: str | None = None,
        env_settings: EnvSettings | None = None,
        env_builder: SlotIdentity | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError("an agent needs at least one slot")
        if identities is not None and len(identities) < slots:
            raise ValueError("an agent with identities needs one for each slot")
        self.client = client
        self.data_dir = Path(data_dir)
        self.slots = slots
        self.queues = list(queues)
        self.drain_timeout = drain_timeout
        self.job_nice = job_nice
        self.confinement = Confinement(job_network)
        self.identities = list(identities) if identities is not None else None
        self.env = passed_env(os.environ if env is None else env)
        self.cache_bytes = cache_bytes
        self.git_protocols = git_protocols
        self.lifetime = lifetime
        self.host = host or socket.gethostname()
        self.gpus: list[GpuInfo] = list(gpus) if gpus is not None else []
        self._discover = gpus is None
        self.probe: GpuProbe | None = None
        self._nvml: Nvml | None = None
        self.worker_id = ""  # the server's worker for this agent (its hello)
        self.kill_grace = kill_grace  # then the one the server's hello says its worker takes
        self.beat_seconds = 10.0  # then the hello's: how often it beats, and how long a beat may take
        self.lease_seconds = 30.0  # then the hello's: with no beat answered for this long, it leaves
        self._ending = ""  # why the agent itself ended its serve (its beats went unanswered)
        self.ended = asyncio.Event()
        self.leaving = asyncio.Event()
        self._hello: asyncio.Future[None] | None = None
        self._calls: AgentCalls | None = None
        self._slots: Slots | None = None
        self._env_settings, self._env_builder = env_settings or EnvSettings(), env_builder
        self.envs: EnvCache | None = None  # its jobs' environments (envs.py), once its slots are
        self._held: Holdings | None = None
        self._beats: Beats | None = None  # (from the hello)
        self._http: aiohttp.ClientSession | None = None
        self._orders: asyncio.Task[None] | None = None
        self._attempts = TaskSet("%s failed in the agent; its lease will lapse")
        self._background = TaskSet("%s failed: the agent no longer works as it should", logging.CRITICAL)
        self._draining = False
        self._served = False  # `served` came: the server's worker for this agent has stopped

    # -- life cycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Find the GPUs, connect, offer the slots, and wait for the server's hello; the slots are
        open once it returns. On failure nothing is left running."""
        await start_or_undo(self._start, self.stop)

    async def _start(self) -> None:
        if self._discover:
            self.gpus, self._nvml = await discover_within()
            self.probe = self._nvml
        await self.client.connect()
        self._hello = asyncio.get_running_loop().create_future()
        offer = ServeJobs(
            slots=self.slots,
            queues=self.queues,
            gpus=[g.to_dict() for g in self.gpus],
            leave_by=self.lifetime.leave_by if self.lifetime is not None else 0.0,
            host=self.host,
            shared_uid=self.identities is None,  # its jobs read its token: its user's jobs only
            drain_timeout=self.drain_timeout,
            kill_grace=self.kill_grace,
            machine={
                "pid": os.getpid(),
                "cpus": os.cpu_count() or 1,
                "memory": psutil.virtual_memory().total,
                "batch_job": registry.batch_job(),
            },
        )
        self._orders = asyncio.create_task(self._serve(offer), name="agent orders")
        try:
            async with asyncio.timeout(HELLO_SECONDS):
                await asyncio.shield(self._hello)
        except TimeoutError:
            raise AgentError(f"the pool server did not answer serve_jobs in {HELLO_SECONDS:g} s") from None
        if self.lifetime is not None:
            self._background.spawn(self._leave_when_due(self.lifetime), "agent lifetime")
        gpus = f"{len(self.gpus)} GPUs" if self.gpus else "CPU only"
        log.info(
            "agent of worker %s ready: %d slots, queues %s, %s",
            self.worker_id,
            self.slots,
            ", ".join(self.queues),
            gpus,
        )

    async def stop(self) -> None:
        """Drain: ask the server's worker to stop (`drain`) and let the jobs run on for up to
        `drain_timeout`, then to stop them now and hand them back (`drain` now, as `force`), wait
        for `served` a while longer, then kill what still runs and close everything. The agent's
        drain_timeout is the one that counts (its pilot's lifetime is reckoned with it), whatever
        the server's is. Safe to call twice."""
        if self._calls is not None and not self.ended.is_set() and not self._draining:
            self._draining = True
            await self._tell("", "drain", {"now": False}, DRAIN_CALL_SECONDS)
            if not await self._served_within(self.drain_timeout):
                await self._tell("", "drain", {"now": True}, DRAIN_CALL_SECONDS)
                wait = self.kill_grace + SERVED_MARGIN
                if not await self._served_within(wait):
                    log.warning(
                        "the pool server did not end this agent's serve %g s after its drain; leaving", wait
                    )
        if self._hello is not None and not self._hello.done():
            self._hello.cancel()  # stopped before its start ended: no one waits for it any more
        self._lose_all("the agent is stopping")
        await self._wait_for_attempts()
        if self._orders is not None:
            await cancel_and_wait(self._orders)
        await self._background.stop()
        await self._attempts.stop()
        await self.client.close()
        if self.envs is not None:  # (its builds sweep the builder's uid with the slots' spawner)
            await self.envs.close()
            self.envs = None
        if self._slots is not None:
            await self._slots.close()
            self._slots = None
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._nvml is not None:
            await close_within(self._nvml)
            self._nvml = None
        self.ended.set()
        log.info("agent of worker %s stopped", self.worker_id)

    async def _served_within(self, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self.ended.wait()
        return self.ended.is_set()

    def force(self) -> None:
        """A second signal: the server's worker stops the jobs now (still handed back)."""
        if self._calls is not None and not self.ended.is_set():
            self._draining = True
            drain = self._tell("", "drain", {"now": True}, DRAIN_CALL_SECONDS)
            self._background.spawn(drain, "agent drain now")

    async def _leave_when_due(self, lifetime: Lifetime) -> None:
        assert self._held is not None
        why = await lifetime.due(self._held.quiet_for)
        log.info("agent of worker %s leaving: %s", self.worker_id, why)
        self.leaving.set()  # its owner stops it, as on a signal

    # -- the orders -------------------------------------------------------------------------------

    async def _serve(self, offer: ServeJobs) -> None:
        """Read the server's orders until `served`, or until the connection ends; then every job
        still running is killed, and `ended` and `leaving` set. Each order is stamped as it comes
        and carried out in turn by `_obey` (the first, hello, opens the slots meanwhile)."""
        orders: asyncio.Queue[tuple[float, AgentOrder] | None] = asyncio.Queue()
        obeying = self._background.spawn(self._obey(orders), "agent obeying orders")
        why = "the pool server's serve ended"
        try:
            async for item in self.client.stream(offer):
                if isinstance(item, Served):
                    self._served = True
                    why = f"the pool server's worker for this agent stopped: {item.reason}"
                    orders.put_nowait(None)  # what came before `served` is done first
                    await asyncio.wait({obeying})
                    break
                if isinstance(item, AgentOrder):
                    orders.put_nowait((boottime(), item))
        except ClientError as exc:
            why = self._ending or f"serve_jobs ended: {exc.message}"
        finally:
            await cancel_and_wait(obeying)
            if self._hello is not None and not self._hello.done():
                self._hello.set_exception(
                    AgentError(f"the pool server ended serve_jobs before its hello: {why}")
                )
        running = self._lose_all(why)
        (log.info if self._draining and not running else log.warning)(
            "%s%s", why, f": killing {running} jobs" if running else ""
        )
        self.ended.set()
        self.leaving.set()

    async def _obey(self, orders: asyncio.Queue[tuple[float, AgentOrder] | None]) -> None:
        while (got := await orders.get()) is not None:
            came, order = got
            try:
                await self._order(order, came)
            except (KeyError, TypeError, ValueError, GpupoolError) as exc:  # the server's bug: said, left
                log.error(
                    "the pool server's %s order for %r is malformed (%r); ignored",
                    order.act,
                    order.lease_id,
                    exc,
                )

    async def _order(self, order: AgentOrder, came: float) -> None:
        base = came  # a run's valid_for is provisional: the first beat's answer replaces it
        if order.act == "hello":
            assert self._hello is not None
            try:
                await self._on_hello(order.detail)
            except Exception as exc:  # noqa: BLE001 - the agent's start fails with it (its slots, its data)
                if not self._hello.done():
                    self._hello.set_exception(exc)
                return
            if not self._hello.done():
                self._hello.set_result(None)
            return
        if self._held is None:
            log.error("the pool server sent %s before hello; ignored", order.act)
            return
        if order.act == "run":
            self._run(order.lease_id, order.detail, base)
        else:
            self._for_attempt(order)

    def _for_attempt(self, order: AgentOrder) -> None:
        """An order for one attempt this agent runs: stop it, or tidy its slot."""
        assert self._held is not None
        held = self._held.get(order.lease_id)
        run = held.run if held is not None else None
        if held is None or not isinstance(run, JobRun | None):
            log.warning(
                "the pool server sent %s for attempt %s, which this agent does not run",
                order.act,
                order.lease_id,
            )
            return
        if order.act == "tidy":
            self._attempts.spawn(self._tidy(held, run), f"tidy after {held.lease.job_id}")
            return
        if run is None:
            return  # never started (`_refuse`): it has ended already
        match order.act:
            case "cancel":
                run.cancel()
            case "hand_back":
                run.hand_back(
                    now=bool(order.detail.get("now")), why=str(order.detail.get("why") or "handed back")
                )
            case "lose":
                run.lose(str(order.detail.get("why") or "the pool server took the attempt back"))
            case _:
                log.warning("unknown order %r from the pool server; ignored", order.act)

    async def _on_hello(self, detail: Mapping[str, Any]) -> None:
        """The server's worker for this agent: its id and key, then the slots opened under it."""
        self.worker_id = str(detail["worker"])
        self.kill_grace = float(detail.get("kill_grace", self.kill_grace))
        self.lease_seconds = float(detail["lease_seconds"])
        self.beat_seconds = float(detail.get("beat_seconds", self.lease_seconds / 3))
        # Every call is bounded: a half-open connection must not hold a run, a tidy or a stop.
        self._calls = AgentCalls(self.client, self.worker_id, bytes(detail["key"]), self.lease_seconds)
        self._http = aiohttp.ClientSession(timeout=HTTP_TIMEOUT)
        await asyncio.to_thread(make_data_dir, self.data_dir)
        non_root.check_data_dir(self.data_dir)
        self._slots = Slots(
            self.data_dir,
            self.worker_id,
            self.slots,
            self.identities,
            self.job_nice,
            confinement=self.confinement,
        )
        await self._slots.open()
        self.envs = EnvCache(
            self.data_dir / "envs",
            self._env_settings,
            builder=self._env_builder,
            sweep=self._slots.spawner.sweep,
            env=self.env,
        )
        await asyncio.to_thread(self.envs.open)
        await self.envs.start()
        self._held = Holdings(self._slots.guard)
        self._background.spawn(self._slots.guard.watch_over(), "agent orphan guard watch")
        self._background.spawn(
            self._held.fence(
                "no lease renewal from the pool server in time: the lease may have passed to another worker"
            ),
            "agent fence",
        )
        self._beats = Beats(
            self._calls,
            self._held,
            beat_seconds=self.beat_seconds,
            lease_seconds=self.lease_seconds,
            over=lambda: self.ended.is_set() or self._served,
            silent=self._end_serve,
        )
        self._background.spawn(self._beats.run(), "agent beats")

    async def _end_serve(self, why: str) -> None:
        """No beat answered for a lease (agent_beats.py): the agent ends its serve by closing its
        connection, which kills every job."""
        self._ending = why
        log.error("%s: ending this agent's serve", why)
        self._lose_all(why)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DRAIN_CALL_SECONDS):
                await self.client.close()  # the serve ends with its connection

    def _run(self, lease_id: str, detail: Mapping[str, Any], base: float) -> None:
        # (all set by hello, the first order)
        assert self._held is not None
        assert self._slots is not None
        assert self._calls is not None
        assert self._http is not None
        assert self._beats is not None
        raw = detail["lease"]
        lease = Lease(
            job_id=str(raw["job_id"]),
            attempt=int(raw["attempt"]),
            worker=str(raw["worker"]),
            spec=JobSpec.from_dict(raw["spec"]),
            id=str(raw["id"]),
            shared_gpu=int(raw.get("shared_gpu", -1)),
            ahead=bool(raw.get("ahead", False)),
        )
        if lease.id != lease_id:
            log.error("the pool server's run order for %s carries lease %s; ignored", lease_id, lease.id)
            return
        held = self._held.hold(lease, base + float(detail["valid_for"]))
        self._beats.expect(lease.id)  # the order's valid_for is provisional: a beat's answer follows
        slot = int(detail["slot"])
        by_uuid = {g.uuid: g for g in self.gpus}
        if not all(uuid in by_uuid for uuid in detail.get("gpus", ())) or not 0 <= slot < self.slots:
            # The server's worker for this agent has its slots and GPUs: a bug there.
            log.error(
                "job %s: the pool server asked for a slot or GPUs this agent does not have", lease.job_id
            )
            self._refuse(held, RunResult(Ending.LOST, None))
            return
        if self.identities is None and lease.spec.user != self.client.user:
            # Its jobs run as the agent's own uid, which reads the agent's token: another user's
            # job would act as this agent's user. Its offer said so (shared_uid), so a server
            # that sends one all the same is not to be served: handed back untouched, and the
            # agent leaves, saying why.
            log.error(
                "job %s of %s: this agent runs its jobs as its own uid, which can read its token, so "
                "it runs %s's jobs only, yet the pool server sends it other users' (a server older "
                "than this agent?): handing it back and leaving",
                lease.job_id,
                lease.spec.user,
                self.client.user,
            )
            self._refuse(held, RunResult(Ending.HANDED_BACK, None))
            self.leaving.set()
            return
        gpus = tuple(by_uuid[uuid] for uuid in detail.get("gpus", ()))
        store = TicketStore(self._calls, lease.id, self._http, self.data_dir / "spool")
        exited: list[asyncio.Task[None]] = []
        run = JobRun(
            Relay(self._calls, lease),
            lease,
            data_dir=self.data_dir,
            gpus=gpus,
            env=self.env,
            kill_grace=self.kill_grace,
            probe=self.probe,
            guard=self._slots.guard,
            spawner=self._slots.spawner,
            store=store,
            cache=ObjectCache(self.data_dir / "cache", store, self.cache_bytes),
            envs=self.envs,
            slot=self._slots.scratch[slot],
            identity=self._slots.identity(slot),
            cgroup=self._slots.cgroup(slot),
            git_protocols=self.git_protocols,
            on_exit=lambda: exited.append(
                self._attempts.spawn(self._tell(lease.id, "exited"), f"exit of {lease.job_id}")
            ),
        )
        self._held.started(held, run, slot)  # (lost there if its deadline passed: nothing starts)
        run.start()
        held.task = self._attempts.spawn(self._attempt(held, run, exited), f"job {lease.job_id}")

    def _refuse(self, held: HeldAttempt, result: RunResult) -> None:
        """An attempt not started: its end, `result`, told at once (its slot then needs no tidying)."""
        held.phase = Phase.ENDING
        held.task = self._attempts.spawn(self._report(held, result), f"end of {held.lease.job_id}")

    # -- one attempt ------------------------------------------------------------------------------

    async def _attempt(self, held: HeldAttempt, run: JobRun, exited: list[asyncio.Task[None]]) -> None:
        """Run the attempt to its end and tell the server how it ended."""
        lease = held.lease
        log.info("job %s attempt %d: starting on slot %s", lease.job_id, lease.attempt, held.slot)
        try:
            result = await run.run()
        except Exception:  # a bug: said, and the attempt reported lost (its lease lapses)
            log.exception("job %s attempt %d failed in the agent", lease.job_id, lease.attempt)
            result = RunResult(Ending.LOST, None)
        held.phase = Phase.ENDING
        if result.killed_by is not None and result.ending is not Ending.LOST and held.expired():
            # Killed by a signal after the fence's deadline (maybe by the fence itself, or by the
            # orphan guard while the agent was frozen): not the job's outcome; the lease decides.
            result = RunResult(Ending.LOST, None, result.dirty_gpus, result.killed_by)
        for task in exited:  # `exited` goes before `ended`
            with contextlib.suppress(Exception):
                await task
        await self._report(held, result)

    async def _report(self, held: HeldAttempt, result: RunResult) -> None:
        outcome = result.outcome
        await self._tell(
            held.lease.id,
            "ended",
            {
                "ending": str(result.ending),
                "outcome": None
                if outcome is None
                else {
                    "state": str(outcome.state),
                    "exit_code": outcome.exit_code,
                    "detail": outcome.detail,
                    "result": dict(outcome.result),
                },
                "dirty_gpus": dict(result.dirty_gpus),
                "killed_by": result.killed_by,
            },
        )

    async def _tidy(self, held: HeldAttempt, run: JobRun | None) -> None:
        """After its end: its slot's directories made ready for the next job (None: it never
        started, and touched none), then `tidied`."""
        try:
            if run is not None:
                try:
                    await run.tidy()
                except Exception:  # said; the server's worker must not wait on it
                    log.exception(
                        "job %s: slot %s could not be tidied; telling the pool server it is",
                        held.lease.job_id,
                        held.slot,
                    )
            await self._tell(held.lease.id, "tidied")
        finally:
            if self._beats is not None:
                self._beats.forget(held.lease.id)
            if self._held is not None:
                self._held.drop(held)

    async def _tell(
        self, lease_id: str, call: str, args: Mapping[str, Any] | None = None, within: float | None = None
    ) -> None:
        """An `agent_call` whose answer is only {}, answered `within` seconds (default: a lease,
        after which the server's worker for this agent is gone anyway): a failure is said, and
        left (the connection's end, if that is why, kills the jobs). Once the connection has
        ended nothing is sent: the server's worker for this agent ended with it, and its leases
        lapse."""
        assert self._calls is not None
        if self.client.closed is not None:
            return
        try:
            await self._calls.call(lease_id, call, args, within)
        except (PoolUnreachable, ClientError) as exc:
            # Once `served` has come, the server's worker for this agent is gone: no news to it.
            (log.debug if self._served else log.warning)(
                "cannot tell the pool server %s for %s: %s", call, lease_id or "the agent", exc
            )

    def _lose_all(self, why: str) -> int:
        """Kill every job still running now (nothing of theirs is recorded); how many there were."""
        running = 0
        for held in self._held or ():
            if held.run is not None and held.phase is Phase.RUNNING and not held.run.exited:
                held.run.lose(why)
                running += 1
        return running

    async def _wait_for_attempts(self) -> None:
        tasks = [h.task for h in self._held or () if h.task is not None and not h.task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=self.kill_grace + LOST_SECONDS)
