"""How a failed Redis call is judged: did it maybe run (its reply lost), is it worth another try,
was it a refusal at maxmemory. The queue, the worker and the server all decide by these."""

from __future__ import annotations

from redis.exceptions import OutOfMemoryError, ResponseError

from daemon.queue.scripts import moving


def unanswered(exc: BaseException) -> bool:
    """Whether a failed call may have run in Redis with only its reply lost: a broken connection, a
    timeout or a cancellation may hide a run, and NotReplicated says it ran (on the primary
    alone); an error Redis answered with (ResponseError, such as a refusal at maxmemory) means
    the call had no effect."""
    return not isinstance(exc, ResponseError)


def transient(exc: BaseException) -> bool:
    """Worth trying again: Redis did not answer, or answered that it cannot now (full, loading,
    busy with a script, a replica). Any other error a script answers with is its last word."""
    if not isinstance(exc, ResponseError):
        return True
    return (
        out_of_memory(exc)
        or moving(exc)  # a Redis Cluster moving a slot, or failing over
        or str(exc).startswith(("BUSY", "LOADING", "READONLY", "TRYAGAIN", "MASTERDOWN"))
    )


def out_of_memory(exc: BaseException) -> bool:
    """Redis refused a write at its maxmemory (directly, or inside a script)."""
    return isinstance(exc, OutOfMemoryError) or (isinstance(exc, ResponseError) and "OOM" in str(exc))
