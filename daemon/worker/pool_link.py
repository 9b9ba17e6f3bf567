"""What one attempt's run needs of the pool: its fenced log and checkpoint writes, and its job's
history and stored log.

On a worker that holds the pool's Redis credentials that is the `JobQueue` itself; on an agent
(agent.py), which holds none, it is the attempt's `relay.Relay`, whose every call goes through
the pool server, which makes the write for it. runner.py, job_output.py, checkpoints.py and
job_data.py are written against this protocol, so one JobRun serves both.

A write or read that fails for want of the pool (Redis briefly away, or the agent's link to the
server down) raises one of `UNREACHABLE`: the callers keep what they have and ask again, or give
up on what can wait, as they always did for a Redis hiccup. Anything else is an answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from redis.exceptions import RedisError

from daemon.errors import GpupoolError
from daemon.job import Attempt, Lease
from protocol import ErrorCode


class PoolUnreachable(GpupoolError):
    """An agent's call for an attempt got no answer from the pool: the link to its server is down,
    or the server could not reach Redis. Like a RedisError on a worker, it may pass."""

    code = ErrorCode.UNAVAILABLE


# What a call may raise when the pool is out of reach for now: worth asking again.
UNREACHABLE: tuple[type[RedisError], type[PoolUnreachable]] = (RedisError, PoolUnreachable)


class JobHistory(Protocol):
    """What a restore reads of its job (checkpoints.counted_attempts): its attempts, oldest first,
    and the save its record names ('' for none)."""

    @property
    def attempts(self) -> Sequence[Attempt]: ...

    @property
    def checkpoint(self) -> str: ...


class PoolLink(Protocol):
    """The pool as one attempt's run sees it (the module's docstring)."""

    async def append_log(self, lease: Lease, number: int, chunks: Sequence[bytes]) -> None:
        """Append the attempt's call `number` of output (written once); StaleAttempt when the
        attempt is no longer current."""

    async def record_checkpoint(self, lease: Lease, name: str) -> bool:
        """Record the complete save `name`; False when the attempt no longer holds the job."""

    async def get(self, job_id: str) -> JobHistory:
        """The job's record (JobNotFound when there is none)."""

    async def read_log(self, job_id: str, after: str, *, count: int) -> list[tuple[str, bytes]]:
        """The job's stored log after entry `after`: (entry id, bytes), at most `count`."""
