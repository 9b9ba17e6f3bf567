"""Agent workers, the server's side (docs/PROTOCOL.md §3.4): `serve_jobs` and `agent_call`.

An agent holds only its user's token. Its `serve_jobs` offers its machine; the server answers by
running a worker for it (worker/hosted.py, built by the factory main.py hands the server: server/
never imports worker code), whose orders this request streams until that worker has stopped, then
`served`. Cancelling the request, or losing the connection, abandons that worker at once: nothing
is handed back for what the agent ran, and the leases lapse for the reaper, as a dead worker's do.

Each `agent_call` names the worker and carries the key of its stream's `hello`, from a connection
of the same user (else PERMISSION_DENIED, with nothing written), and, but for `beat` and `drain`
(the agent's own: `beat` keeps its worker alive, worker/hosted.py), an attempt
that worker has ordered the agent to run and that has not ended (else PERMISSION_DENIED). What it
asks is done with that attempt's own lease, so Redis fences every write as a worker's, and the
store calls (agent_store.py) sign only that attempt's own keys. An agent of a non-admin user is
served only that user's jobs (the worker's claims pass others' over), so a job that reads the
agent's token on the agent's machine can act only as that user already may.

Bounds: MAX_AGENTS_PER_USER live streams per non-admin user (each is a worker with a heartbeat,
a blocking read for work and a subscription for cancels: two Redis connections), MAX_AGENTS in
all, and MAX_AGENT_SLOTS slots per agent. A `serve_jobs` lasts as long as its agent, so it does
not hold one of the user's blocking reads (handlers.blocking_read): these bounds stand for them.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from daemon.config import Config
from daemon.errors import GpupoolError
from daemon.job import Lease
from daemon.object_store import attempt_segment
from daemon.queue.job_queue import JobQueue
from daemon.server.agent_store import AgentStore
from daemon.spec_checks import QUEUE_NAME
from protocol import AgentAnswer, AgentCall, AgentOrder, ErrorCode, Served, ServeJobs, StreamItem
from storage.base import ObjectStore

log = logging.getLogger(__name__)

MAX_AGENTS_PER_USER = 16
MAX_AGENTS = 256
MAX_AGENT_SLOTS = 64
MAX_AGENT_GPUS = 1024
MAX_AGENT_QUEUES = 16  # each a stream its worker reads on every wait for work
# What one append_log carries at most: what a worker's own JobOutput sends (worker/job_output.py),
# so that log.lua's trim keeps a log within log_max_bytes as it does a worker's.
MAX_LOG_CHUNKS = 16
MAX_LOG_CHUNK = 64 * 1024
MAX_LOG_PAGE = 1000  # chunks one read_log answers at most
BATCH_JOB = re.compile(r"(?:slurm|pbs):[A-Za-z0-9._\[\]-]{1,64}")
# What a registration shows of an agent's machine (registry.Registration), each value judged.
MACHINE: dict[str, Callable[[Any], bool]] = {
    "pid": lambda v: isinstance(v, int) and 0 <= v < 2**31,
    "cpus": lambda v: isinstance(v, int) and 0 <= v < 2**20,
    "memory": lambda v: isinstance(v, int) and 0 <= v < 2**62,
    "batch_job": lambda v: isinstance(v, str) and (v == "" or BATCH_JOB.fullmatch(v) is not None),
}
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")  # it names the worker: WORKER/REQUEST.INDEX
STREAM_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")
STOP_SLACK = 10.0  # seconds beyond drain_timeout + kill_grace the agents have to end at a server stop

SendStream = Callable[[StreamItem], Awaitable[None]]


class AgentAttempt(Protocol):
    """What the server needs of an attempt an agent runs (worker/hosted.py's RemoteRun)."""

    @property
    def lease(self) -> Lease: ...

    def told(self, call: str, args: Mapping[str, Any]) -> None:
        """The agent's `exited`, `ended` or `tidied`; GpupoolError for arguments it refuses."""


class AgentWorker(Protocol):
    """The worker the server runs for one agent (worker/hosted.py's HostedWorker)."""

    id: str
    key: bytes
    why: str  # why it stopped

    async def start(self) -> None: ...

    async def stop(self, drain_timeout: float | None = None) -> None: ...

    def force(self) -> None: ...

    def leave(self, why: str) -> None: ...

    def drain(self, now: bool) -> None: ...

    def beat(self) -> dict[str, float]:
        """The agent's `beat`: it is alive; seconds each lease it runs surely holds from now."""

    async def abandon(self, why: str) -> None: ...

    async def next_order(self) -> AgentOrder | None: ...

    def attempt(self, lease_id: str, call: str) -> AgentAttempt | None: ...


# Builds the worker for an agent's offer: on the server's queue and configuration, serving one
# user's jobs ("": everyone's, for an admin's agent). GpupoolError for an offer it refuses.
AgentWorkerFactory = Callable[[JobQueue, Config, ServeJobs, str], AgentWorker]


@dataclass(eq=False)
class LiveAgent:
    """One `serve_jobs` stream: whose, and the worker it runs."""

    user: str
    worker: AgentWorker


def _denied(message: str) -> GpupoolError:
    return GpupoolError(message, ErrorCode.PERMISSION_DENIED)


def _invalid(message: str) -> GpupoolError:
    return GpupoolError(message, ErrorCode.INVALID_ARGUMENT)


def check_offer(offer: ServeJobs) -> None:
    """A `serve_jobs` whose machine can be served, else INVALID_ARGUMENT saying what is wrong."""
    if not 1 <= offer.slots <= MAX_AGENT_SLOTS:
        raise _invalid(f"an agent offers 1 to {MAX_AGENT_SLOTS} slots, not {offer.slots}: run several agents")
    if not offer.queues or any(not isinstance(q, str) or not QUEUE_NAME.fullmatch(q) for q in offer.queues):
        raise _invalid("queues must name one or more queues (1-64 of A-Za-z0-9_-)")
    if len(offer.queues) > MAX_AGENT_QUEUES:
        raise _invalid(f"an agent takes at most {MAX_AGENT_QUEUES} queues, not {len(offer.queues)}")
    if not isinstance(offer.host, str) or not HOST_NAME.fullmatch(offer.host):
        raise _invalid(
            "host must be the machine's name: 1-63 of A-Za-z0-9._-, starting with a letter or digit"
        )
    if offer.leave_by < 0:
        raise _invalid("leave_by must be Unix seconds, or 0 for no end")
    for key, value in offer.machine.items():
        if key not in MACHINE or not MACHINE[key](value):
            raise _invalid(
                f"machine's {key!r} is not one the server shows (pid, cpus and memory: whole numbers "
                "at least 0; batch_job: slurm:ID or pbs:ID)"
            )
    if len(offer.gpus) > MAX_AGENT_GPUS:
        raise _invalid(f"an agent offers at most {MAX_AGENT_GPUS} GPUs")
    uuids = set()
    for gpu in offer.gpus:
        fields = (("index", int), ("uuid", str), ("name", str), ("memory", int))
        if not isinstance(gpu, Mapping) or any(not isinstance(gpu.get(k), t) for k, t in fields):
            raise _invalid(
                "each of gpus must be a map of index (int), uuid (str), name (str), memory (int bytes)"
            )
        uuids.add(gpu["uuid"])
    if len(uuids) != len(offer.gpus):
        raise _invalid("each GPU's uuid must be its own: two GPUs share one")


class Agents:
    """The live agents of this server: `serve` and `call` are the two requests; `stop()` at the
    server's stop, while the listener still carries their streams (each drains as its worker
    does); `force()` at a second signal."""

    def __init__(
        self,
        factory: AgentWorkerFactory | None,
        queue: JobQueue,
        config: Config,
        store: ObjectStore | None,
        admins: frozenset[str],
    ) -> None:
        """`factory`: None on a server that runs no agent workers (serve_jobs is refused)."""
        self.factory = factory
        self.queue = queue
        self.config = config
        self.store = AgentStore(store) if store is not None else None
        self.admins = admins
        self._live: dict[str, LiveAgent] = {}  # by worker id
        self._stopping = False

    def _per_user(self) -> Counter[str]:
        return Counter(a.user for a in self._live.values())

    def _check_room(self, user: str) -> None:
        if self._stopping:
            raise GpupoolError(
                "the server is stopping: offer the machine again once it is back", ErrorCode.UNAVAILABLE
            )
        if len(self._live) >= MAX_AGENTS:
            raise GpupoolError(
                f"the server already runs {MAX_AGENTS} agents, the most it takes; retry later",
                ErrorCode.RESOURCE_EXHAUSTED,
            )
        if user not in self.admins and self._per_user()[user] >= MAX_AGENTS_PER_USER:
            raise GpupoolError(
                f"{user} already has {MAX_AGENTS_PER_USER} agents serving jobs, the most one user may: "
                "stop one, or give one agent more slots",
                ErrorCode.RESOURCE_EXHAUSTED,
            )

    # -- serve_jobs ------------------------------------------------------------------------------

    async def serve(self, offer: ServeJobs, user: str, send: SendStream) -> Served:
        """Run a worker for the agent and stream its orders until it has stopped."""
        if self.factory is None:
            raise GpupoolError("this server runs no agent workers", ErrorCode.UNAVAILABLE)
        check_offer(offer)
        self._check_room(user)
        # An admin's agent serves everyone, unless its jobs run as its own uid and could read its token.
        everyone = user in self.admins and not offer.shared_uid
        worker = self.factory(self.queue, self.config, offer, "" if everyone else user)
        if worker.id in self._live:  # 64 random bits: never, but one agent's id is never another's
            raise GpupoolError("an agent's worker id came out taken; offer again", ErrorCode.UNAVAILABLE)
        self._live[worker.id] = LiveAgent(user, worker)
        try:
            await worker.start()  # on failure nothing of it runs
            log.info(
                "agent worker %s of %s: %d slots on %s, queues %s",
                worker.id,
                user,
                offer.slots,
                offer.host,
                ", ".join(offer.queues),
            )
            try:
                while (order := await worker.next_order()) is not None:
                    await send(order)
            except BaseException:  # cancelled, or the connection is gone: nothing handed back
                await worker.abandon("the agent's connection ended")
                raise
            return Served(worker.why or "the worker stopped")
        finally:
            del self._live[worker.id]

    # -- agent_call ------------------------------------------------------------------------------

    async def call(self, request: AgentCall, user: str) -> AgentAnswer:
        live = self._live.get(request.worker)
        key = request.key if isinstance(request.key, bytes) else b""
        if live is None or live.user != user or not hmac.compare_digest(live.worker.key, key):
            raise _denied(
                f"no agent of {user} serves jobs as worker {request.worker!r} with that key: an agent's "
                "calls carry the worker and key of its serve_jobs stream's hello, while it lasts"
            )
        args = request.args if isinstance(request.args, Mapping) else {}
        if request.call in ("beat", "drain"):
            if request.lease_id:
                raise _invalid(f"{request.call} is the agent's, not an attempt's: send it with lease_id \"\"")
            if request.call == "beat":
                return AgentAnswer({"valid_for": live.worker.beat()})
            live.worker.drain(bool(args.get("now")))
            return AgentAnswer({})
        attempt = live.worker.attempt(request.lease_id, request.call)
        if attempt is None:
            raise _denied(
                f"worker {request.worker} runs no attempt {request.lease_id!r} that may {request.call!r} "
                "now: an attempt's calls come between its run order and its end (tidied after its tidy)"
            )
        return AgentAnswer(await self._for(attempt, request.call, args))

    async def _for(self, attempt: AgentAttempt, call: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """One call for `attempt`, made with its lease (fenced by Redis, as a worker's)."""
        match call:
            case "exited" | "ended" | "tidied":
                attempt.told(call, args)
                return {}
            case "append_log" | "record_checkpoint" | "job" | "read_log":
                return await self._queue_call(attempt.lease, call, args)
            case "store_get" | "store_list" | "store_put":
                if self.store is None:
                    raise GpupoolError("this server has no object store", ErrorCode.UNAVAILABLE)
                return await self.store.call(attempt.lease, call, args)
        raise _invalid(f"unknown agent call {call!r} (docs/PROTOCOL.md §3.4 lists them)")

    async def _queue_call(self, lease: Lease, call: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """The attempt's writes to, and reads of, its job in Redis."""
        match call:
            case "append_log":
                number, chunks = args.get("number"), args.get("chunks")
                if not isinstance(number, int) or number < 1:
                    raise _invalid("append_log's number counts the attempt's calls from 1")
                if not isinstance(chunks, list) or not all(isinstance(c, bytes) for c in chunks):
                    raise _invalid("append_log's chunks must be a list of bytes")
                if len(chunks) > MAX_LOG_CHUNKS or any(len(c) > MAX_LOG_CHUNK for c in chunks):
                    raise _invalid(
                        f"append_log carries at most {MAX_LOG_CHUNKS} chunks of at most "
                        f"{MAX_LOG_CHUNK // 1024} KiB each, as a worker's own output does"
                    )
                await self.queue.append_log(lease, number, chunks)  # StaleAttempt: CONFLICT
                return {}
            case "record_checkpoint":
                name, own = args.get("name"), attempt_segment(lease.id)
                if not isinstance(name, str) or not re.fullmatch(rf"{re.escape(own)}\.[0-9]{{1,9}}", name):
                    raise _denied(f"an attempt records its own saves only: {own}.N")
                return {"recorded": await self.queue.record_checkpoint(lease, name)}
            case "job":
                info = await self.queue.get(lease.job_id)
                earlier = [a.to_dict() for a in info.attempts if a.lease != lease.id]
                return {"attempts": earlier, "checkpoint": info.checkpoint}
        after, count = args.get("after") or "0-0", args.get("count")  # read_log
        if not isinstance(after, str) or not STREAM_ID.fullmatch(after):
            raise _invalid('read_log\'s after is a log entry id (MS-SEQ), or "" for the start')
        if not isinstance(count, int) or count < 1:
            raise _invalid("read_log's count must be a positive integer")
        chunks = await self.queue.read_log(lease.job_id, after, count=min(count, MAX_LOG_PAGE))
        return {"chunks": [[entry_id, data] for entry_id, data in chunks]}

    # -- the server's stop ---------------------------------------------------------------------------

    def force(self) -> None:
        """A second stop signal: every agent's jobs are stopped now and handed back."""
        for live in list(self._live.values()):
            live.worker.force()

    async def stop(self) -> None:
        """Stop every agent's worker as a worker stops (drain, then hand back through the agent),
        within drain_timeout + kill_grace + STOP_SLACK; an agent not done by then is abandoned
        (its attempts left to lapse). No new agent is taken from here on."""
        self._stopping = True
        workers = [live.worker for live in self._live.values()]
        if not workers:
            return
        for worker in workers:
            worker.leave("the server is stopping")
        bound = self.config.drain_timeout + self.config.kill_grace + STOP_SLACK
        try:
            async with asyncio.timeout(bound):
                await asyncio.gather(*(w.stop() for w in workers))
        except TimeoutError:
            log.warning(
                "%d agents did not end their jobs in %g s; leaving their leases to lapse", len(workers), bound
            )
            await asyncio.gather(*(w.abandon("the server is stopping") for w in workers))
