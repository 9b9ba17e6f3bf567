"""gpupool run as an unprivileged uid, as a cluster user runs a pilot: an interpreter that uid may
execute, with this one's packages and the repository on its path.

The tests' own interpreter may live where no other uid may enter (pyenv under /root, mode 700):
the venv's `python` is then a link another uid cannot exec, and a worker that starts its helper
processes with `sys.executable` could not start them. The system's python of the same minor
version then stands in (C extensions of one minor version share its ABI), given this one's
site-packages and the repository through PYTHONPATH.
"""

from __future__ import annotations

import os
import stat
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.paths import ROOT


def _others_may_run(path: Path) -> bool:
    """Whether any uid may reach and execute `path` (each directory above it passable by others)."""
    try:
        if not path.stat().st_mode & stat.S_IXOTH:
            return False
        return all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)
    except OSError:
        return False


def python() -> str:
    """An interpreter of this one's minor version that every uid may execute."""
    real = Path(os.path.realpath(sys.executable))
    if _others_may_run(real):
        return str(real)
    return f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"


def pythonpath() -> str:
    """The repository, then this interpreter's site-packages (the venv's packages)."""
    return os.pathsep.join([str(ROOT), sysconfig.get_paths()["purelib"]])


@contextmanager
def reachable() -> Iterator[None]:
    """Every directory above the repository and the packages made passable (o+x, never listable)
    while the block runs, as they are on a machine with its checkout under /home or /srv: a clone
    made in a `mktemp -d` directory (0700), or under /root, is closed to every other uid. Each mode
    changed is put back after."""
    opened: list[tuple[Path, int]] = []
    try:
        for place in (ROOT, Path(sysconfig.get_paths()["purelib"])):
            for d in reversed([place, *place.parents]):
                mode = d.stat().st_mode
                if not mode & stat.S_IXOTH:
                    opened.append((d, stat.S_IMODE(mode)))
                    d.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
        yield
    finally:
        for d, mode in reversed(opened):
            d.chmod(mode)
