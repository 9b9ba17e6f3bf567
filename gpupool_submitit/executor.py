"""`submitit.AutoExecutor(folder, cluster="gpupool")`: submitit's executor for a gpupool pool.

Registered through the "submitit" entry points (pyproject.toml), as submitit finds its plugins.
Each submission is one gpupool job running `in_job.run_submission(delayed)` through gpupool's
Python API (`Pool.map`), and several at once (`map_array`, `submit_array`, `with
executor.batch()`) are one gpupool array. The result comes back through the pool, as any
function's does, never through `folder`, which the job does not share with this process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cloudpickle
from submitit.core.core import Executor, Job
from submitit.core.utils import DelayedSubmission

import gpupool
from gpupool_submitit import in_job, parameters
from gpupool_submitit.job import GpupoolJob

# The job runs in_job's code without gpupool installed: cloudpickle carries it by value.
cloudpickle.register_pickle_by_value(in_job)


class GpupoolExecutor(Executor):
    """submitit's executor for gpupool. `pool`: a connected `gpupool.Pool` (its defaults apply to
    every job), or the name of one, chosen with `server` as `gpupool.connect(pool, server=server)`
    chooses (pools.toml, the environment, then `local`); given to an AutoExecutor as
    `gpupool_pool=` and `gpupool_server=`."""

    job_class = GpupoolJob

    def __init__(
        self, folder: str | Path, pool: gpupool.Pool | str | None = None, server: str | None = None
    ) -> None:
        super().__init__(folder)
        self._pool = pool if isinstance(pool, gpupool.Pool) else None
        self._pool_name = pool if isinstance(pool, str) else None
        self._server = server

    @classmethod
    def _valid_parameters(cls) -> set[str]:
        return set(parameters.GPUPOOL_PARAMETERS)

    def _internal_update_parameters(self, **kwargs: Any) -> None:
        super()._internal_update_parameters(**parameters.checked(kwargs))

    def _internal_process_submissions(self, delayed_submissions: list[DelayedSubmission]) -> list[Job[Any]]:
        options = {"name": _name_of(delayed_submissions[0]), **parameters.submit_options(self.parameters)}
        jobs = self._connect().map(in_job.run_submission, delayed_submissions, **options)
        return [GpupoolJob(self.folder, job, ds) for job, ds in zip(jobs, delayed_submissions, strict=True)]

    @classmethod
    def affinity(cls) -> int:
        """Available, but chosen only when named (cluster="gpupool"): installing gpupool does not
        move anyone's AutoExecutor off the cluster it picked before."""
        return 0

    def _connect(self) -> gpupool.Pool:
        if self._pool is None:
            self._pool = gpupool.connect(self._pool_name, server=self._server)
        return self._pool


def _name_of(delayed: DelayedSubmission) -> str:
    """The job's name when none is given: the function's, as `poolctl ls` shows it."""
    fn = delayed.function
    return str(getattr(fn, "__name__", None) or type(fn).__name__)
