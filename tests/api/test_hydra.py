"""issue 48: Hydra's launcher, `hydra/launcher=gpupool`, run for real. A small Hydra app (written
below into a git repository of its own, as a researcher's project is) runs as a subprocess with
`-m`, its sweep goes to the module's pool (tests/api/conftest.py) as one array, and each run's
return value and output directory come back.

The app's sweeper is Hydra's basic one plus a record: it writes what each run returned, as Hydra
received it, and the output directory its JobReturn names, to $RETURNS, the only way to see them
from outside the app's process (Hydra's sweepers, Optuna's for one, read them; `-m` prints nothing)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

import gpupool
from tests.api.conftest import ApiPool
from tests.support.paths import ROOT

APP = """\
import os
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def train(cfg: DictConfig) -> dict:
    if cfg.seed < 0:
        raise ValueError(f"seed {cfg.seed} is negative")
    job = os.environ["GPUPOOL_JOB_ID"]
    out = Path(HydraConfig.get().runtime.output_dir)
    (out / "model.txt").write_text(f"lr={cfg.lr} seed={cfg.seed} job={job}")
    return {"lr": cfg.lr, "seed": cfg.seed, "job": job}


if __name__ == "__main__":
    train()
"""

RECORDING_SWEEPER = """\
import json
import os
from dataclasses import dataclass
from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper, BasicSweeperConf
from hydra.core.config_store import ConfigStore


@dataclass
class RecordingSweeperConf(BasicSweeperConf):
    _target_: str = "hydra_plugins.recording_sweeper.RecordingSweeper"


ConfigStore.instance().store(group="hydra/sweeper", name="recording", node=RecordingSweeperConf)


class RecordingSweeper(BasicSweeper):
    def sweep(self, arguments):
        returns = super().sweep(arguments)
        values = [
            {**r.return_value, "output_dir": r.hydra_cfg.hydra.runtime.output_dir}
            for batch in returns
            for r in batch
        ]
        Path(os.environ["RETURNS"]).write_text(json.dumps(values))
        return returns
"""

SWEEP_SECONDS = 90
SWEEPS = {
    "sweep-ok": ("lr=1e-3,3e-4", "seed=1,2"),
    "sweep-fails": ("seed=2,-1",),
    "sweep-refused": ("seed=1,2", "hydra.launcher.gpus=-1"),
}
HYDRA_FILES = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")


def hydra_app(where: Path) -> Path:
    """The app in `where`: my_app.py, its config and its sweeper, in a git working tree."""
    (where / "my_app.py").write_text(APP)
    (where / "conf").mkdir()
    (where / "conf" / "config.yaml").write_text("lr: 0.1\nseed: 0\n")
    (where / "hydra_plugins").mkdir()
    (where / "hydra_plugins" / "recording_sweeper.py").write_text(RECORDING_SWEEPER)
    (where / ".gitignore").write_text("multirun/\nreturns.json\n")  # what a sweep writes: not the project
    subprocess.run(["git", "init", "-q", str(where)], check=True, timeout=10)
    return where


@dataclass(frozen=True)
class Sweep:
    """A finished sweep: the app's exit status and stderr, its sweep directory (multirun/DATE/TIME,
    as Hydra names it), and what Hydra received from each run (None: the sweep failed before)."""

    returncode: int
    stderr: str
    sweep_dir: Path
    returns: list[dict[str, Any]] | None


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory: pytest.TempPathFactory, api_pool: ApiPool) -> dict[str, Sweep]:
    """The sweeps of SWEEPS, run at once (each app in a directory of its own), their jobs named as
    the sweep is."""
    started = {}
    for name, overrides in SWEEPS.items():
        app = hydra_app(tmp_path_factory.mktemp(name))
        env = {**api_pool.env("alice"), "PYTHONPATH": str(ROOT), "RETURNS": str(app / "returns.json")}
        argv = [sys.executable, "my_app.py", "-m", *overrides, "hydra/launcher=gpupool"]
        argv += [f"hydra.launcher.name={name}", "hydra/sweeper=recording"]
        started[name] = app, subprocess.Popen(argv, cwd=app, env=env, stderr=subprocess.PIPE, text=True)
    finished = {}
    try:
        for name, (app, proc) in started.items():
            _, stderr = proc.communicate(timeout=SWEEP_SECONDS)
            made = list(app.glob("multirun/*/*"))
            assert len(made) == 1, stderr  # Hydra made its sweep's directory, and only one
            returned = app / "returns.json"
            returns = json.loads(returned.read_text()) if returned.exists() else None
            finished[name] = Sweep(proc.returncode, stderr, made[0], returns)
    finally:
        for _, proc in started.values():  # none left running when one hung or failed
            proc.kill()
            proc.wait()
    return finished


def test_a_sweep_goes_as_one_array_and_each_run_comes_back(
    sweeps: dict[str, Sweep], as_alice: ApiPool
) -> None:
    """issue 48, "Hydra (`-m` sweep of 4 runs with hydra/launcher=gpupool) runs for real": the 4
    runs are 4 jobs of one array in the pool's records; Hydra receives each run's return value
    as its task returned it, in the sweep's order; and each run's output directory is where Hydra
    puts it locally (multirun/DATE/TIME/N), with its .hydra/, its log and the file its task wrote,
    and the job's own output beside them."""
    sweep = sweeps["sweep-ok"]
    assert sweep.returncode == 0, sweep.stderr
    assert sweep.returns is not None
    points = [(1e-3, 1), (1e-3, 2), (3e-4, 1), (3e-4, 2)]
    assert [(r["lr"], r["seed"]) for r in sweep.returns] == points
    with gpupool.connect() as pool:
        records = [pool.job(r["job"]).record() for r in sweep.returns]
    assert len({r["id"] for r in records}) == 4
    [array] = {r["spec"]["array"] for r in records}
    assert array, records
    assert {r["spec"]["name"] for r in records} == {"sweep-ok"}  # hydra.launcher.name
    for num, ((lr, seed), run) in enumerate(zip(points, sweep.returns, strict=True)):
        run_dir = sweep.sweep_dir / str(num)
        assert OmegaConf.load(run_dir / ".hydra" / "config.yaml") == {"lr": lr, "seed": seed}
        assert (run_dir / "model.txt").read_text() == f"lr={lr} seed={seed} job={run['job']}"
        files = {p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file()}
        assert files == {*HYDRA_FILES, "model.txt", "my_app.log", f"{run['job']}.log"}
        assert run["output_dir"] == str(run_dir)  # the JobReturn says where its output is now
    assert (sweep.sweep_dir / "multirun.yaml").is_file()


def test_a_failed_run_is_reported_as_hydra_reports_one(sweeps: dict[str, Sweep]) -> None:
    """issue 48, "a failing run is reported as Hydra reports failures": the sweep fails as it would
    with Hydra's own launcher (exit status 1, "Error executing job with overrides", the
    exception), with the task's own traceback from its job as the cause; the other run's output,
    and the failed run's own, still come back."""
    sweep = sweeps["sweep-fails"]
    assert sweep.returncode == 1, sweep.stderr
    assert "Error executing job with overrides: ['seed=-1']\n" in sweep.stderr
    assert sweep.stderr.endswith("\nValueError: seed -1 is negative\n")
    remote = sweep.stderr.split("The above exception was the direct cause")[0]
    assert ", in train\n" in remote
    assert remote.endswith('ValueError: seed -1 is negative\n"""\n\n')
    assert (sweep.sweep_dir / "0" / "model.txt").is_file()
    assert OmegaConf.load(sweep.sweep_dir / "1" / ".hydra" / "config.yaml") == {"lr": 0.1, "seed": -1}


def test_a_sweep_the_pool_cannot_take_is_one_sentence(sweeps: dict[str, Sweep]) -> None:
    """issue 48, bad input gets a sentence: launcher options the pool cannot use (gpus=-1) end the
    app with what was wrong, as Hydra reports a mistake in its own configuration, not a traceback."""
    sweep = sweeps["sweep-refused"]
    assert sweep.returncode == 1, sweep.stderr
    assert sweep.stderr == (
        "hydra/launcher=gpupool: gpus=-1: a whole number from 0 to 1024\n"
        "\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n"
    )
