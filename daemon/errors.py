"""Errors that reach a human: each carries a stable code and one sentence saying what to do.

The codes are strings so they read well in logs, JSON output and protocol ERROR frames alike.
"""

from __future__ import annotations


class GpupoolError(Exception):
    """Base of every error gpupool reports to a user; `str(err)` is the sentence to show."""

    code = "error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(GpupoolError):
    """A configuration value is unknown, of the wrong type, or out of range."""

    code = "bad_config"

    def __init__(self, key: str, source: str, problem: str) -> None:
        super().__init__(f"{source}: {key}: {problem}")
        self.key = key
        self.source = source


class InvalidJob(GpupoolError):
    """A job spec (or job id) does not have the shape the pool needs."""

    code = "invalid_job"

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"job {field}: {problem}")
        self.field = field


class NoWorkerFits(GpupoolError):
    """A job asks for more GPUs than any worker of the pool that serves its queue has."""

    code = "no_worker_fits"

    def __init__(self, gpus: int, queue: str, largest: int | None) -> None:
        have = (
            f"no worker serving queue {queue!r} has joined the pool"
            if largest is None
            else f"the largest worker serving queue {queue!r} has {largest}"
        )
        super().__init__(
            f"needs {gpus} GPU{'s' if gpus != 1 else ''}; {have}. Enqueue it with --wait-for-worker "
            "to keep it queued until such a worker joins (the jobs behind it run meanwhile)"
        )
        self.gpus = gpus
        self.largest = largest


class JobNotFound(GpupoolError):
    code = "not_found"

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id!r} in this pool (finished jobs are kept for a limited time)")
        self.job_id = job_id


class StaleAttempt(GpupoolError):
    """A worker wrote for an attempt that is no longer the job's current one (fencing)."""

    code = "stale_attempt"

    def __init__(self, job_id: str, attempt: int, detail: str) -> None:
        super().__init__(f"job {job_id} attempt {attempt} is no longer current: {detail}")
        self.job_id = job_id
        self.attempt = attempt


class RedisUnavailable(GpupoolError):
    code = "redis_unavailable"
