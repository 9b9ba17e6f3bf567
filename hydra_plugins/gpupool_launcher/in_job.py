"""What one run of a sweep does inside its gpupool job: Hydra's own `run_job`, with the run's output
directory in `GPUPOOL_OUTPUT`, whose files come back as the job's artifacts.

Nothing here is composed again in the job: the client composed each run's configuration with its
overrides, where the config files and the command line are, and the job only runs it.

No `from __future__ import annotations` here: Hydra's plugin scan runs this module before it is in
sys.modules, where `dataclass` looks up the module of a string annotation, and fails."""

import os
from dataclasses import dataclass
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, run_job
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict, read_write


@dataclass(frozen=True)
class Runs:
    """The runs of one batch of a sweep, as their jobs receive them: the array's function, pickled
    once by the client (cloudpickle) for the whole array and unpickled only in the jobs of the
    user who sent it. Each job calls it with its own run's configuration."""

    task_function: TaskFunction
    # The callbacks of `hydra.callbacks`, which run_job calls in the job as it does in a local run.
    hydra_context: HydraContext
    # Hydra's singletons (the config store, the resolvers, JobRuntime's job name) as the client had
    # them, so that a run's configuration resolves in the job as it would on the client.
    singleton_state: Any

    def __call__(self, config: DictConfig) -> JobReturn:
        """Run the run of `config` (its whole configuration, `hydra` node too, composed by the
        client with the run's overrides) as Hydra's basic launcher would, but in its job:
        `hydra.job.id` is the gpupool job's id, `hydra.runtime.output_dir` the job's GPUPOOL_OUTPUT,
        `hydra.runtime.cwd` its working directory.

        A run whose task raised fails its job with that exception (and its traceback), as a job
        does whose function raised; run_job has already written its output directory and called
        the callbacks' on_job_end."""
        Singleton.set_state(self.singleton_state)
        with open_dict(config.hydra.job):
            config.hydra.job.id = os.environ["GPUPOOL_JOB_ID"]
        with read_write(config.hydra.runtime):
            config.hydra.runtime.output_dir = os.environ["GPUPOOL_OUTPUT"]
            # The run's original working directory (hydra.utils.get_original_cwd, to_absolute_path):
            # where the job started, the place in the project's copy that the client ran from.
            config.hydra.runtime.cwd = os.getcwd()
        job_return = run_job(
            task_function=self.task_function,
            config=config,
            job_dir_key="hydra.runtime.output_dir",
            job_subdir_key=None,
            hydra_context=self.hydra_context,
        )
        # For a failed run, the property writes "Error executing job with overrides: [...]" to the
        # job's log, as Hydra does on the client, and raises the task's exception.
        _ = job_return.return_value
        return job_return
