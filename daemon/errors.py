"""Errors that reach a human: each carries the wire protocol's code and one sentence saying what
was wrong and what to do.

One hierarchy for the whole daemon and poolctl: `code` is the `protocol.ErrorCode` an ERROR frame
carries when the error answers a request (so the server maps any of them to a frame in one line),
and `message` is the sentence `poolctl` prints as-is. A class sets its usual code; an instance may
carry another (`GpupoolError(sentence, ErrorCode.UNAVAILABLE)`). Errors that never cross the wire
(a bad config file, a port in use) keep the default, INTERNAL, which no client ever sees.
"""

from __future__ import annotations

import time

from protocol.errors import ErrorCode


class GpupoolError(Exception):
    """Base of every error gpupool reports to a user; `str(err)` is the sentence to show."""

    # an int, not only ErrorCode: a client keeps a code from a newer server it does not know
    code: int = ErrorCode.INTERNAL

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class ConfigError(GpupoolError):
    """A configuration value is unknown, of the wrong type, or out of range."""

    def __init__(self, key: str, source: str, problem: str) -> None:
        super().__init__(f"{source}: {key}: {problem}")
        self.key = key
        self.source = source


class InvalidJob(GpupoolError):
    """A job spec (or job id) does not have the shape the pool needs."""

    code = ErrorCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"job {field}: {problem}")
        self.field = field


class NoWorkerFits(GpupoolError):
    """A job asks for more GPUs (or more memory on one GPU) than any worker of the pool that serves
    its queue has. `needs` and `largest` say it in words ("4 GPUs", "2")."""

    code = ErrorCode.INVALID_ARGUMENT

    def __init__(self, needs: str, queue: str, largest: str | None) -> None:
        have = (
            f"no worker serving queue {queue!r} has joined the pool"
            if largest is None
            else f"the largest worker serving queue {queue!r} has {largest}"
        )
        super().__init__(
            f"needs {needs}; {have}. Enqueue it with --wait-for-worker to keep it queued until such "
            "a worker joins (the jobs behind it run meanwhile)"
        )


class NoWorkerServes(GpupoolError):
    """A job names a queue that no worker of the pool serves (a typo, mostly): it would wait
    forever. `served` are the queues the pool's workers serve."""

    code = ErrorCode.INVALID_ARGUMENT

    def __init__(self, queue: str, served: list[str]) -> None:
        super().__init__(
            f"no worker of this pool serves queue {queue!r} (its workers serve: {', '.join(served)}). "
            "Enqueue it with --wait-for-worker to keep it queued until such a worker joins"
        )


class JobNotFound(GpupoolError):
    code = ErrorCode.NOT_FOUND

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id!r} in this pool (finished jobs are kept for a limited time)")
        self.job_id = job_id


class NotYours(GpupoolError):
    """A user asked to act on another user's job (or its data), and is not a pool admin."""

    code = ErrorCode.PERMISSION_DENIED

    def __init__(self, job_id: str, owner: str, action: str) -> None:
        super().__init__(f"job {job_id} belongs to {owner}: only its owner or a pool admin may {action} it")
        self.job_id = job_id


class PriorityTooHigh(GpupoolError):
    """A job asked for a priority above its user's ceiling (max_priority, set by the pool's admin)."""

    code = ErrorCode.PERMISSION_DENIED

    def __init__(self, asked: int, ceiling: int) -> None:
        what = f"use --priority {ceiling} or less" if ceiling else "leave --priority out"
        super().__init__(
            f"priority {asked} is above your ceiling of {ceiling}: {what}, or ask the pool's admin "
            "to raise your max_priority in the tokens file"
        )


class TooManyUnended(GpupoolError):
    """A submission would take its user past the most jobs they may have queued or running in one
    queue (user_max_queued_jobs, set by the pool's admin): one user cannot fill the pool's Redis.
    RESOURCE_EXHAUSTED: nothing of the submission was written, and it goes through once some of
    their jobs end."""

    code = ErrorCode.RESOURCE_EXHAUSTED

    def __init__(self, user: str, queue: str, has: int, adding: int, most: int) -> None:
        super().__init__(
            f"{user} has {has} job{'s' if has != 1 else ''} queued or running in queue {queue!r}; "
            f"{adding} more would pass the {most} one user may have there (user_max_queued_jobs in "
            "the pool's config): nothing of this submission was queued; wait for some to end, or cancel "
            "some, then submit again"
        )
        self.user = user
        self.queue = queue


class TooMuchStored(GpupoolError):
    """A submission would take its user past the bytes they may hold in the pool's Redis, over
    every queue (user_max_stored_bytes, set by the pool's admin): a job's record stays for the
    retention after it ends, so without this one user could fill Redis for everyone by
    submitting and cancelling (queue/lua/store.lua). RESOURCE_EXHAUSTED: nothing of the
    submission was written; room comes back as days of their submissions age out."""

    code = ErrorCode.RESOURCE_EXHAUSTED

    def __init__(self, user: str, held: int, adding: int, most: int, back_at: float) -> None:
        when = (
            "a submission this large never fits: make the jobs' specs smaller, or submit fewer at once"
            if not back_at
            else "room comes back as their submissions of each day age out, from "
            + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(back_at))
            + "; make specs smaller, or ask the pool's admin"
        )
        super().__init__(
            f"{user} has submitted {_mib(held)} of jobs still kept in the pool (ended or not, for "
            f"the retention); {_mib(adding)} more would pass the {_mib(most)} one user may hold "
            f"(user_max_stored_bytes in the pool's config): {when}. Nothing of this submission "
            "was queued"
        )
        self.user = user


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _bytes(nbytes: int) -> str:
    return _mib(nbytes) if nbytes >= 2**20 else f"{nbytes} bytes"


class OverBound(GpupoolError):
    """A job spec larger than the pool takes (job_spec_max_bytes, job_name_max_chars): what one
    user puts in the pool's Redis, and in every listing, is bounded."""

    code = ErrorCode.INVALID_ARGUMENT

    def __init__(self, what: str, size: int, most: int, unit: str, option: str) -> None:
        super().__init__(
            f"job {what} is {size} {unit}, more than the {most} this pool takes ({option} in the "
            "pool's config): make it shorter (a long command or environment can go in a file the "
            "job reads, with --input)"
        )


class ProjectTooLarge(GpupoolError):
    """A job's project larger than the pool takes (project_max_bytes): datasets go with `poolctl
    put`, once, not with every job."""

    code = ErrorCode.INVALID_ARGUMENT

    def __init__(self, size: int, most: int, biggest: str = "") -> None:
        super().__init__(
            f"the project is {_bytes(size)}, more than the {_bytes(most)} a job's project may be "
            f"(project_max_bytes){biggest}: list data and build output in .poolignore, and send "
            "datasets once with `poolctl put PATH --name NAME` (then --input NAME), or run with "
            "--workdir none"
        )


class StaleAttempt(GpupoolError):
    """A worker wrote for an attempt that is no longer the job's current one (fencing)."""

    code = ErrorCode.CONFLICT

    def __init__(self, job_id: str, attempt: int, detail: str) -> None:
        super().__init__(f"job {job_id} attempt {attempt} is no longer current: {detail}")
        self.job_id = job_id
        self.attempt = attempt


class IdempotencyConflict(GpupoolError):
    """An idempotency key sent again with a spec other than the one it was first used for: the
    first job is not this one, so it is not answered as if it were (as payment APIs refuse a key
    reused with other parameters)."""

    code = ErrorCode.CONFLICT

    def __init__(self, key: str, job_id: str) -> None:
        super().__init__(
            f"idempotency key {key!r} was used for job {job_id}, with another spec: a key names one "
            "submission; send that job's very command and options again, or use a new --key"
        )
        self.key = key
        self.job_id = job_id


class RedisUnavailable(GpupoolError):
    code = ErrorCode.UNAVAILABLE


class NotReplicated(GpupoolError):
    """A write reached the primary Redis but not the replicas it must reach to be acknowledged
    (redis_min_replicas_ack): the primary's loss now could lose it. The request is safe to repeat:
    an enqueue with its idempotency key, an outcome by its lease."""

    code = ErrorCode.UNAVAILABLE

    def __init__(self, acked: int, wanted: int, timeout_ms: int) -> None:
        super().__init__(
            f"written to the pool's Redis primary, but only {acked} of the {wanted} replicas it must "
            f"reach (redis_min_replicas_ack) had it within {timeout_ms} ms, so it is not acknowledged: "
            "if the primary failed now it could be lost. It may be kept all the same: try again with "
            "the same --key, which gives the same job back (without a key, a second try may make a "
            "second job); if this goes on, check the replicas"
        )
        self.acked = acked
        self.wanted = wanted
