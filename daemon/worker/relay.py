"""An agent's calls to the pool server (`agent_call`, docs/PROTOCOL.md §3.4), and each attempt's
link to the pool through them.

An agent (agent.py) holds no Redis credential: every write for an attempt it runs (its log, its
checkpoint records) and every read of its job (its history, its stored log) is an `agent_call` the
server answers for the worker it runs for the agent, which makes the fenced write itself. Each call
carries the worker id and key of the stream's `hello`, and the attempt's lease id.

`AgentCalls` is the agent's one caller; `Relay` is one attempt's `pool_link.PoolLink` over it, so
the JobRun of an agent is the JobRun of a worker. What the server's answers mean to the run:

- the link down (connection lost, the server shutting down) or the server without its Redis
  (UNAVAILABLE): `PoolUnreachable`, which the run treats as a Redis hiccup (pool_link.py);
- an append refused (CONFLICT: no longer current; PERMISSION_DENIED: the server no longer holds the
  attempt for this agent): `StaleAttempt`, and the run kills the job, as a worker's does;
- a checkpoint record refused for the same reasons: not recorded (False);
- no such job: `JobNotFound`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from daemon.client.pool_client import ClientError, PoolClient, ServerUnreachable
from daemon.errors import GpupoolError, JobNotFound, StaleAttempt
from daemon.job import Attempt, Lease
from daemon.worker.pool_link import PoolUnreachable
from protocol import AgentAnswer, AgentCall, ErrorCode

T = TypeVar("T")

# Answers that say the pool is out of reach for now, not that the call was wrong.
_UNREACHABLE_CODES = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.SHUTTING_DOWN})


class BadAnswer(GpupoolError):
    """The server answered a call with a value of another shape than §3.4 says."""


def unreachable(client: PoolClient, exc: ClientError) -> bool:
    """Whether a failed call failed for want of the pool (worth asking again), not on its merits:
    the connection is gone, or the server cannot reach its Redis, or is stopping."""
    return isinstance(exc, ServerUnreachable) or exc.code in _UNREACHABLE_CODES or client.closed is not None


class AgentCalls:
    """The agent's `agent_call`s on `client`, as the worker `worker` with the stream's `key`, each
    answered within `within` seconds unless a call says otherwise (None: no bound)."""

    def __init__(self, client: PoolClient, worker: str, key: bytes, within: float | None = None) -> None:
        self.client = client
        self.worker = worker
        self.key = key
        self.within = within

    async def call(
        self,
        lease_id: str,
        call: str,
        args: Mapping[str, Any] | None = None,
        within: float | None = None,
    ) -> dict[str, Any]:
        """The value of call `call` for attempt `lease_id` ("" for the agent as a whole). Raises
        PoolUnreachable when the pool is out of reach, or gives no answer `within` that many
        seconds (a half-open connection, a frozen server), else the server's ClientError."""
        request = AgentCall(self.worker, self.key, lease_id, call, dict(args or {}))
        within = self.within if within is None else within
        try:
            async with asyncio.timeout(within):
                answer = await self.client.call(request, AgentAnswer)
        except TimeoutError:
            what = f"{call} for {lease_id or 'the agent'}"
            raise PoolUnreachable(f"{what}: no answer in {within:g} s") from None
        except ClientError as exc:
            if unreachable(self.client, exc):
                raise PoolUnreachable(f"{call} for {lease_id or 'the agent'}: {exc.message}") from exc
            raise
        return answer.value


@dataclass(frozen=True, slots=True)
class JobRecord:
    """What the server tells of an attempt's job: its attempts and its recorded save."""

    attempts: tuple[Attempt, ...]
    checkpoint: str


class Relay:
    """`pool_link.PoolLink` for the attempt `lease`, over the agent's `calls` (module docstring)."""

    def __init__(self, calls: AgentCalls, lease: Lease) -> None:
        self.calls = calls
        self.lease = lease

    async def _call(self, call: str, args: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return await self.calls.call(self.lease.id, call, args)

    def _own(self, job_id: str) -> None:
        if job_id != self.lease.job_id:  # a bug: an attempt's relay reads only its own job
            raise ValueError(f"attempt {self.lease.id} asked for job {job_id}, not its own")

    async def append_log(self, lease: Lease, number: int, chunks: Sequence[bytes]) -> None:
        try:
            await self.calls.call(lease.id, "append_log", {"number": number, "chunks": list(chunks)})
        except ClientError as exc:
            if exc.code in (ErrorCode.CONFLICT, ErrorCode.PERMISSION_DENIED):
                raise StaleAttempt(
                    lease.job_id, lease.attempt, f"its log is closed to it ({exc.message})"
                ) from None
            raise

    async def record_checkpoint(self, lease: Lease, name: str) -> bool:
        try:
            value = await self.calls.call(lease.id, "record_checkpoint", {"name": name})
        except ClientError as exc:
            if exc.code in (ErrorCode.CONFLICT, ErrorCode.PERMISSION_DENIED):
                return False
            raise
        return _field(value, "recorded", bool, "record_checkpoint")

    async def get(self, job_id: str) -> JobRecord:
        self._own(job_id)
        try:
            value = await self._call("job")
        except ClientError as exc:
            if exc.code == ErrorCode.NOT_FOUND:
                raise JobNotFound(job_id) from None
            raise
        try:
            attempts = tuple(_attempt(a) for a in _field(value, "attempts", list, "job"))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadAnswer(f"the server's answer to job has an attempt of another shape: {exc}") from None
        return JobRecord(attempts, _field(value, "checkpoint", str, "job"))

    async def read_log(self, job_id: str, after: str, *, count: int) -> list[tuple[str, bytes]]:
        self._own(job_id)
        try:
            value = await self._call("read_log", {"after": after, "count": count})
        except ClientError as exc:
            if exc.code == ErrorCode.NOT_FOUND:
                raise JobNotFound(job_id) from None
            raise
        chunks = _field(value, "chunks", list, "read_log")
        if not all(
            isinstance(c, list | tuple) and len(c) == 2 and isinstance(c[0], str) and isinstance(c[1], bytes)
            for c in chunks
        ):
            raise BadAnswer("the server's answer to read_log has chunks that are not [entry id, bytes]")
        return [(entry, data) for entry, data in chunks]


def _field(value: Mapping[str, Any], name: str, kind: type[T], call: str) -> T:
    got = value.get(name)
    if not isinstance(got, kind):
        raise BadAnswer(f"the server's answer to {call} has no {name} of type {kind.__name__}")
    return got


def _attempt(entry: Mapping[str, Any]) -> Attempt:
    """One entry of a job's history, as `Attempt.to_dict` writes it."""
    ended = entry["ended_at"]
    return Attempt(
        attempt=int(entry["attempt"]),
        worker=str(entry["worker"]),
        started_at=float(entry["started_at"]),
        ended_at=None if ended is None else float(ended),
        how=str(entry["how"]),
        lease=str(entry.get("lease", "")),
    )
