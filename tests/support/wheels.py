"""Hermetic Python packages for the environment tests: wheels made by hand in a local wheelhouse,
and projects locked against it by the real uv with no index (nothing leaves the machine)."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import zipfile
from pathlib import Path

from daemon.worker.env_build import find_uv


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_wheel(wheelhouse: Path, name: str, version: str = "1.0", body: str = "") -> Path:
    """A pure-Python wheel of package `name` whose module holds `body` (default: VERSION and a
    `main` that prints it), with a console script `name` that runs `main`."""
    wheelhouse.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": (
            body or f"VERSION = {version!r}\n\ndef main():\n    print({name!r}, VERSION)\n"
        ),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: gpupool-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
        f"{info}/entry_points.txt": f"[console_scripts]\n{name} = {name}:main\n",
    }
    path = wheelhouse / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in files.items():
            wheel.writestr(member, text)
        record = [_record_line(m, t.encode()) for m, t in files.items()] + [f"{info}/RECORD,,"]
        wheel.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def locked_project(project: Path, wheelhouse: Path, *requirements: str, python: str = ">=3.11") -> Path:
    """A project in `project` that needs `requirements`, locked (uv.lock) against `wheelhouse`
    alone, as a researcher's `uv lock` would make it on their laptop."""
    project.mkdir(parents=True, exist_ok=True)
    deps = ", ".join(f'"{r}"' for r in requirements)
    (project / "pyproject.toml").write_text(
        f'[project]\nname = "{project.name}"\nversion = "0.1"\nrequires-python = "{python}"\n'
        f"dependencies = [{deps}]\n"
    )
    uv = find_uv()
    assert uv is not None, "uv is a dependency of gpupool: make install"
    subprocess.run(
        [uv, "lock", "--no-index", "--find-links", str(wheelhouse), "--quiet", "--no-config"],
        cwd=project,
        check=True,
        timeout=60,
    )
    return project
