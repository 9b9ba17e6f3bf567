"""Where a job's project is (issue 45 item 1): what daemon/ctl/project.py lists, found here with a
few stats and no event loop, so that an enqueue outside any project loads nothing more.

A project is a git working tree (its top level), else the nearest directory at or above poolctl's
holding one of MARKERS, looked for below the user's home and the root: neither is ever a project (a
home kept in git for its dotfiles must not go with every job).
"""

from __future__ import annotations

import os
from pathlib import Path

MARKERS = ("pyproject.toml", "requirements.txt", "uv.lock")


def real(path: Path) -> Path:
    """`path` absolute, with no symlink in it: how the functions here, and project.py's, take theirs."""
    return Path(os.path.realpath(path))


def maybe_within(start: Path, home: Path) -> bool:
    """Whether `start` may be in a project: a `.git` or a marker at or above it, below home and
    the root (project.py `find` then asks git). Both paths `real`."""
    for directory in (start, *start.parents):
        if directory in (home, Path("/")):
            return False
        if (directory / ".git").exists() or any((directory / m).is_file() for m in MARKERS):
            return True
    return False


def marked_root(start: Path, home: Path) -> Path | None:
    """The nearest directory at or above `start`, below `home` and the root, holding a marker."""
    for directory in (start, *start.parents):
        if directory in (home, Path("/")):
            return None
        if any((directory / marker).is_file() for marker in MARKERS):
            return directory
    return None
