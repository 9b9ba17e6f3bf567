"""The worker's C module (_spawn.c), or, in a package installed without it, a stand-in that refuses.

setup.py builds the module only on Linux, and not with GPUPOOL_NO_WORKER_MODULE=1 (a laptop's
install, for poolctl). Such a package must still import: poold's modules import the worker's, and
its server and poolctl run without a worker. So the worker's modules take the module from here,
and poold checks `require()` before a worker starts: one sentence saying what to do, not an
ImportError's traceback. A call on the stand-in raises the same sentence, should one come first."""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

from daemon.errors import GpupoolError

# _spawn: the worker's modules take it from here
__all__ = ["ABSENT", "NotBuilt", "_spawn", "built", "require"]

ABSENT = (
    "this gpupool was installed without the worker's C module (daemon/worker/_spawn.c), which "
    "starts a worker's jobs: a worker runs on Linux only; install gpupool there with a C compiler "
    "and without GPUPOOL_NO_WORKER_MODULE set"
)


class NotBuilt(GpupoolError):
    """This install has no C module, and something needs it: a worker, or a server's own slots."""


class _Absent:
    """What the worker's modules hold in place of the C module when it was not built."""

    def __getattr__(self, name: str) -> NoReturn:
        raise NotBuilt(ABSENT)


if TYPE_CHECKING:
    from daemon.worker import _spawn
else:
    try:
        from daemon.worker import _spawn
    except ImportError:  # not built: see setup.py
        _spawn = _Absent()


def built() -> bool:
    """Whether this install has the C module."""
    return not isinstance(_spawn, _Absent)


def require(hint: str = "") -> None:
    """NotBuilt saying the C module is missing and what to do (`hint`: what else may be done)."""
    if not built():
        raise NotBuilt(ABSENT + hint)
