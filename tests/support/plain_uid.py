"""Run a process of this test suite's Python as a plain uid, the way a worker that is not root (a
pilot, a worker on one person's machine) runs: no capabilities, no groups, no way back to root.

This interpreter may live where other uids cannot pass (pyenv under /root, mode 0700). Such a
process then gets a mount namespace of its own in which that directory is replaced by a 0711 one
holding only the way to the interpreter (a bind of it): the process reads this Python and this
checkout, nothing else of the directory it was under, and the machine's mounts are left alone.
"""

from __future__ import annotations

import stat
import sys
from collections.abc import Sequence
from pathlib import Path


def as_uid(uid: int, argv: Sequence[str], scratch: Path) -> list[str]:
    """The command line that runs `argv` as `uid` (gid the same); `scratch` is an empty directory
    the namespace mounts over (the test removes it)."""
    drop = [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
    ]
    blocked = _first_closed(Path(sys.base_prefix).resolve())
    if blocked is None:
        return [*drop, *argv]
    way_in = Path(sys.base_prefix).resolve().relative_to(blocked).parts[0]
    script = (
        'set -e; mount -t tmpfs -o mode=0711 gpupool-test "$1"; '
        f'mkdir "$1/{way_in}"; mount --rbind "{blocked / way_in}" "$1/{way_in}"; '
        f'mount --rbind "$1" "{blocked}"; shift; exec "$@"'
    )
    unshare = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]
    return [*unshare, str(scratch), *drop, *argv]


def _first_closed(path: Path) -> Path | None:
    """The outermost directory above `path` that others may not pass, or None."""
    closed = None
    for directory in path.parents:
        if not directory.stat().st_mode & stat.S_IXOTH:
            closed = directory
    return closed
