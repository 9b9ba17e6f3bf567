"""A submitit Job that is a gpupool job: its state, result, cancel and log come from the pool.

submitit's own Jobs read result pickles from a folder the cluster shares with the client; a gpupool
job shares no folder with it, so this Job holds the gpupool Job (gpupool's Python API) and asks it:
the result comes back as gpupool brings any function's result (an artifact, verified, unpickled
only here), and submitit's folder is not used.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

from submitit.core.core import Job, R
from submitit.core.utils import DelayedSubmission, FailedJobError, UncompletedJobError

import gpupool

# gpupool's states in Slurm's words, which submitit's users test `job.state` against.
SLURM_STATES = {
    "queued": "PENDING",
    "running": "RUNNING",
    "succeeded": "COMPLETED",
    "failed": "FAILED",
    "cancelled": "CANCELLED",
    "dead": "NODE_FAIL",  # its workers died under it more often than it may be retried
}


class GpupoolJob(Job[R]):
    """submitit's Job for one gpupool job (an array's jobs are one each, as Slurm's are)."""

    def __init__(self, folder: str | Path, job: gpupool.Job, submission: DelayedSubmission) -> None:
        self._job: gpupool.Job | None = job
        self._submission: DelayedSubmission | None = submission
        link = job.pool.link  # how its pool was reached: by name in pools.toml, else by address
        self._reach = (link.name, None if link.name else link.server)
        super().__init__(folder, job.id)

    def _register_in_watcher(self) -> None:
        """Nothing to register: the gpupool Job follows its own state (submitit's watcher polls
        sacct for Slurm's jobs)."""

    @property
    def state(self) -> str:
        """The job's state in Slurm's words (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED)."""
        state = self._gp.state
        return SLURM_STATES.get(state, state.upper())

    def get_info(self, mode: str = "force") -> dict[str, str]:
        return {"State": self.state}

    def done(self, force_check: bool = False) -> bool:
        return self._gp.done()

    def wait(self) -> None:
        concurrent.futures.wait([self._gp])

    def cancel(self, check: bool = True) -> None:
        """Cancel the job: a queued one never runs, a running one is stopped (its stop signal,
        then SIGKILL); one that has ended is left as it is."""
        self._gp.cancel()

    def submission(self) -> DelayedSubmission:
        """The call submitted (with attributes `function`, `args` and `kwargs`)."""
        if self._submission is None:
            raise RuntimeError(
                f"job {self.job_id} was unpickled: its submitted call stays with the process that "
                "submitted it (`poolctl show` shows the job)"
            )
        return self._submission

    def results(self) -> list[R]:
        """The function's return value, in a list as submitit's are (one task); its exception
        raises FailedJobError carrying the job's traceback (the exception itself is its
        `__cause__`), and a job that ended without a result raises UncompletedJobError."""
        try:
            return [self._gp.result()]
        except (gpupool.JobFailed, concurrent.futures.CancelledError) as exc:
            raise UncompletedJobError(f"job {self.job_id} has no result: {exc}") from exc
        except gpupool.RemoteError as exc:
            raise self._failed(str(exc)) from exc
        except BaseException as exc:
            # The function's own, SystemExit included, carries the job's traceback as its cause;
            # anything else is this process's (Ctrl-C, the pool out of reach), not the job's.
            if not isinstance(exc.__cause__, gpupool.RemoteTraceback):
                raise
            raise self._failed(exc.__cause__.tb) from exc

    def exception(self) -> UncompletedJobError | FailedJobError | None:
        """What `result()` would raise, or None."""
        try:
            self.results()
        except (UncompletedJobError, FailedJobError) as exc:
            return exc
        return None

    def stdout(self) -> str | None:
        """The job's log so far (its stdout and stderr, merged as gpupool keeps them)."""
        log: str = self._gp.logs()
        return log

    def stderr(self) -> str | None:
        """The same log as stdout(): gpupool keeps the two streams merged."""
        return self.stdout()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled, it is the job's id and how its pool was reached: unpickled, in this process or
        another, it follows the same job through a connection of its own (gpupool's `pool.job`).
        The submitted call is left out: pickle cannot take every callable."""
        return {**self.__dict__, "_job": None, "_submission": None}

    @property
    def _gp(self) -> gpupool.Job:
        """The gpupool Job, found again by its id after unpickling."""
        if self._job is None:
            self._job = _pool_reached(*self._reach).job(self.job_id)
        return self._job

    def __del__(self) -> None:
        if self._cancel_at_deletion and not self.done():
            self.cancel(check=False)

    def _failed(self, trace: str) -> FailedJobError:
        return FailedJobError(
            f"Job {self.job_id} failed during processing with trace:\n"
            f"----------------------\n{trace}\n----------------------\n"
            f"You can check its full log with 'job.stdout()' or 'poolctl logs {self.job_id}'"
        )


# The pools unpickled jobs were found again through, one connection each for all their jobs.
_reached: dict[tuple[str | None, str | None], gpupool.Pool] = {}


def _pool_reached(name: str | None, server: str | None) -> gpupool.Pool:
    if (name, server) not in _reached:
        _reached[name, server] = gpupool.connect(name, server=server)
    return _reached[name, server]
