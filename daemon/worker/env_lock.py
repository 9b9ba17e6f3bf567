"""A job's lock: the files in its directory that say exactly which packages its environment holds.

`uv.lock` with its `pyproject.toml`, else `pylock.toml`, else a `requirements.txt` whose every
requirement is pinned with a hash; a `.python-version` goes with any. Read from the job's own
directory, so never through a symlink, and bounded in size. The environment built from it is
envs.py's.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from daemon.errors import GpupoolError

# The files that make a lock, in the order one is looked for; `.python-version` goes with any.
UV_LOCK, PYPROJECT, PYLOCK, REQUIREMENTS, PYTHON_VERSION = (
    "uv.lock",
    "pyproject.toml",
    "pylock.toml",
    "requirements.txt",
    ".python-version",
)
LOCK_NAMES = (UV_LOCK, PYLOCK, REQUIREMENTS)
MAX_LOCK_BYTES = 16 * 2**20  # of one lock file: a lock of thousands of packages is a few MB


class EnvError(GpupoolError):
    """The job's environment could not be had; the attempt fails with this sentence."""


@dataclasses.dataclass(frozen=True, slots=True)
class Lock:
    """A job's lock: its kind (the lock file's name) and the bytes of the files a build needs."""

    kind: str
    files: Mapping[str, bytes]

    def digest(self) -> str:
        h = hashlib.sha256(self.kind.encode())
        for name in sorted(self.files):
            h.update(f"\0{name}\0{len(self.files[name])}\0".encode())
            h.update(self.files[name])
        return h.hexdigest()


def has_lock(directory: Path) -> bool:
    """Whether `directory` may hold a lock (a stat per name): a job without one starts at once."""
    return any(os.path.lexists(directory / name) for name in LOCK_NAMES)


def find_lock(directory: Path) -> Lock | None:
    """The lock in `directory`, or None where it has none (a `requirements.txt` that is not
    hash-pinned is none: it does not say exactly what to install). EnvError for one that cannot
    be read. Blocking: run it in a thread."""
    if (lock := _read(directory, UV_LOCK)) is not None:
        pyproject = _read(directory, PYPROJECT)
        if pyproject is None:
            raise EnvError(f"the job's directory has {UV_LOCK} but no {PYPROJECT}, which uv needs with it")
        files = {UV_LOCK: lock, PYPROJECT: pyproject}
        kind = UV_LOCK
    elif (lock := _read(directory, PYLOCK)) is not None:
        files, kind = {PYLOCK: lock}, PYLOCK
    elif (lock := _read(directory, REQUIREMENTS)) is not None and hash_pinned(lock):
        files, kind = {REQUIREMENTS: lock}, REQUIREMENTS
    else:
        return None
    if (version := _read(directory, PYTHON_VERSION)) is not None:
        files[PYTHON_VERSION] = version
    return Lock(kind, files)


def _read(directory: Path, name: str) -> bytes | None:
    """The bytes of the regular file `name` in `directory`, or None where there is none. Never
    through a symlink: the directory is the job's, and its link to a file of the worker's would
    hand that file to the builder and to uv's error messages."""
    try:
        fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise EnvError(f"the job's {name} is a symbolic link: a lock must be a file of its own") from None
        raise EnvError(f"cannot read the job's {name}: {exc.strerror}") from None
    with open(fd, "rb") as file:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise EnvError(f"the job's {name} is not a regular file")
        if st.st_size > MAX_LOCK_BYTES:
            raise EnvError(f"the job's {name} is larger than {MAX_LOCK_BYTES} bytes")
        return file.read(MAX_LOCK_BYTES + 1)


def hash_pinned(text: bytes) -> bool:
    """Whether a requirements file pins every requirement to a version and its hashes, and has no
    options (an index, another file, an editable path: what is installed is the lock's alone)."""
    logical = text.decode(errors="replace").replace("\\\r\n", " ").replace("\\\n", " ")
    requirements = 0
    for raw in logical.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-") or "==" not in line or "--hash=" not in line:
            return False
        requirements += 1
    return requirements > 0
