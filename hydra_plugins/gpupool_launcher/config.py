"""The launcher's configuration, `hydra/launcher=gpupool`: where the sweep goes and what each run
needs, in the words of `gpupool.connect` and `Pool.map`.

No `from __future__ import annotations` here: Hydra's plugin scan runs this module before it is in
sys.modules, where `dataclass` looks up the module of a string annotation, and fails."""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore


@dataclass
class GpupoolLauncherConf:
    """Each field but `pool` is passed to `Pool.map` as it is (one left None: the pool's default),
    for every run of the sweep alike; `hydra.launcher.gpus=1` on the command line sets it for one
    sweep."""

    _target_: str = "hydra_plugins.gpupool_launcher.launcher.GpupoolLauncher"
    # The pool, by its name in pools.toml; None: the one poolctl would talk to (GPUPOOL_POOL, the
    # file's default, or a GPUPOOL_SERVER named directly).
    pool: str | None = None
    # The queue the runs join; None: the pool's default queue.
    queue: str | None = None
    # Whole GPUs each run holds.
    gpus: int = 0
    # Instead of whole GPUs: the memory each run needs on one GPU it may share, e.g. "20G".
    gpu_mem: str | None = None
    # Seconds after which the pool stops a run; None: no limit.
    timeout: float | None = None
    # The jobs' name, as `poolctl ls` shows it.
    name: str | None = "${hydra.job.name}"


ConfigStore.instance().store(
    group="hydra/launcher", name="gpupool", node=GpupoolLauncherConf, provider="gpupool"
)
