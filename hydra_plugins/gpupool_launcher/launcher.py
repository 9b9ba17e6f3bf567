"""The launcher: a batch of Hydra's runs sent to a gpupool pool as one array, each run's output
directory brought back to where Hydra's basic launcher would have written it.

Each run's configuration is composed here, on the client (`load_sweep_config`), where the config
files are; its job runs it (in_job.py) in the client's project and environment, as every gpupool
function job does. The runs' return values come back as the jobs' results, their output
directories as the jobs' artifacts, and a run that failed as its job's exception, which Hydra
reports as it reports any failed run."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.errors import CompactHydraException
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

import hydra_plugins.gpupool_launcher as plugin_package
from hydra_plugins.gpupool_launcher.in_job import Runs

if TYPE_CHECKING:
    import gpupool

log = logging.getLogger(__name__)


class GpupoolLauncher(Launcher):
    """`hydra/launcher=gpupool`; its parameters are GpupoolLauncherConf's fields (config.py)."""

    def __init__(
        self,
        *,
        pool: str | None,
        queue: str | None,
        gpus: int,
        gpu_mem: str | None,
        timeout: float | None,
        name: str | None,
    ) -> None:
        self.pool_name = pool
        # What every job of the sweep asks the pool for, as Pool.map's keywords; one left unset
        # (None) is the pool's default.
        asked = {"queue": queue, "gpus": gpus, "gpu_mem": gpu_mem, "timeout": timeout, "name": name}
        self.job_options: dict[str, Any] = {k: v for k, v in asked.items() if v is not None}
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Send the batch as one array and wait for every run of it; the returns are in the order
        of `job_overrides`, each run's output directory downloaded before they are returned."""
        # Hydra imports this module whenever any Hydra app starts, to find its plugins: only a sweep
        # sent to the pool needs gpupool's client.
        import cloudpickle  # noqa: PLC0415 - as gpupool

        import gpupool  # noqa: PLC0415 - as the comment above says

        # This package goes to the jobs by value, as a function of __main__ does: a job needs Hydra
        # (the app does) but nothing of gpupool installed in its environment, as any function's job.
        cloudpickle.register_pickle_by_value(plugin_package)

        assert self.config is not None
        assert self.task_function is not None
        assert self.hydra_context is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info("Launching %d jobs on gpupool", len(job_overrides))
        configs = []
        for num, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info("\t#%d : %s", num, " ".join(filter_overrides(overrides)))
            config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(config):
                config.hydra.job.num = num
            configs.append(config)
        runs = Runs(self.task_function, self.hydra_context, Singleton.get_state())
        try:
            with gpupool.connect(self.pool_name) as pool:
                jobs = pool.map(runs, configs, **self.job_options)
                log.info("Sent as %d jobs: %s", len(jobs), " ".join(job.id for job in jobs))
                return [collect(job, config) for job, config in zip(jobs, configs, strict=True)]
        except gpupool.Error as exc:
            # No pool answering, options it cannot use, an output directory that could not come
            # back: its sentence alone, as Hydra prints a mistake in its own configuration.
            raise CompactHydraException(f"hydra/launcher=gpupool: {exc}") from exc


def collect(job: gpupool.Job, config: DictConfig) -> JobReturn:
    """Wait for `job`, download its output directory, and return its run's JobReturn: the one the
    job returned, or, for a job that failed, one that carries its exception, as run_job's do."""
    error = job.exception()  # a job cancelled, killed or timed out: gpupool.JobFailed, saying so
    output_dir = local_output_dir(config, job.id)
    job.artifacts(output_dir)
    drop_outcome(output_dir)
    if error is not None:
        failed = JobReturn(overrides=list(config.hydra.overrides.task), status=JobStatus.FAILED)
        failed.return_value = error
        return failed
    job_return = job.result()
    assert isinstance(job_return, JobReturn)
    return moved(job_return, output_dir)


def drop_outcome(output_dir: Path) -> None:
    """Remove the function call's outcome from the run's files: the job's runner left it in
    GPUPOOL_OUTPUT, for the client, which has read it as the job's result (gpupool/_runner.py)."""
    from gpupool._runner import RESULT  # noqa: PLC0415 - as launch imports gpupool

    outcome = output_dir / RESULT
    outcome.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # kept where the task wrote files of its own beside it
        outcome.parent.rmdir()


def local_output_dir(config: DictConfig, job_id: str) -> Path:
    """The directory Hydra would have given this run on this machine: `hydra.sweep.dir` /
    `hydra.sweep.subdir`, resolved with `hydra.job.id` the job's id, as in the job."""
    config = copy.deepcopy(config)
    with open_dict(config.hydra.job):
        config.hydra.job.id = job_id
    hydra_config = HydraConfig.instance()
    before = hydra_config.cfg
    hydra_config.set_config(config)  # for a ${hydra:...} in the sweep's directory names
    try:
        sweep_dir = str(OmegaConf.select(config, "hydra.sweep.dir"))
        subdir = str(OmegaConf.select(config, "hydra.sweep.subdir"))
    finally:
        hydra_config.cfg = before
    return (Path(sweep_dir) / subdir).absolute()


def moved(job_return: JobReturn, output_dir: Path) -> JobReturn:
    """`job_return` saying where its output directory is now: the job's GPUPOOL_OUTPUT it names
    (as `hydra.runtime.output_dir`, and as its working directory when the task ran in it,
    `hydra.job.chdir`) is `output_dir` here. The files it wrote there are left as written."""
    assert job_return.hydra_cfg is not None
    runtime = job_return.hydra_cfg.hydra.runtime
    if job_return.working_dir == runtime.output_dir:
        job_return.working_dir = str(output_dir)
    with read_write(runtime):
        runtime.output_dir = str(output_dir)
    return job_return
