"""A function call shipped to a job, and its outcome brought back.

Out: the client pickles the function once and each call's arguments (cloudpickle: a function
defined in a notebook or `__main__` goes by value, one from an importable module by reference) into
one zip archive with the in-job runner as its `__main__.py` (gpupool/_runner.py) and the client's
own cloudpickle package, so the job needs nothing of gpupool installed. The archive is uploaded
content-addressed (daemon/ctl/transfer.py) and becomes the job's input; the job runs
`python ARCHIVE` with the project's environment's Python. The server stores and hands on bytes it
never unpickles, and only the user who uploaded them may have a job read them (data_desk.py).
A `map` is one archive for the whole array: each job reads its own call's arguments by its
$GPUPOOL_ARRAY_INDEX.

Back: the runner writes the outcome to $GPUPOOL_OUTPUT/gpupool/result.pickle; the worker uploads it
as an artifact and records its sha256; the client downloads it through `transfer.download`, which
checks that sha256 before the file is read; the bytes are unpickled only in the thread that asks
for the result (`Fetched.load`), and only for the user's own function's job.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle

from daemon.client.pool_client import PoolClient
from daemon.ctl import transfer
from gpupool._runner import RESULT
from gpupool.errors import BadArgument, JobFailed, RemoteError, RemoteTraceback

ARCHIVE = ".gpupool-call.pyz"  # where the archive is placed, at the top of the job's directory
_RUNNER = Path(__file__).with_name("_runner.py")
_STAMP = (1980, 1, 1, 0, 0, 0)  # every member's time: the same calls make the same archive
Call = tuple[tuple[Any, ...], dict[str, Any]]


def archive(fn: Callable[..., Any], calls: Sequence[Call]) -> bytes:
    """The archive for `fn` called with each of `calls` (args, kwargs): BadArgument, saying which,
    when the function or an argument cannot be pickled."""
    if not callable(fn):
        raise BadArgument(f"{fn!r} is not callable: give a function (or any callable) to run in the job")
    members = [("__main__.py", _RUNNER.read_bytes()), *_cloudpickle_source()]
    members.append(("fn.pickle", _dumps(fn, f"the function {_name(fn)}")))
    for i, call in enumerate(calls):
        what = f"the arguments of {_name(fn)}" + (f" (call {i})" if len(calls) > 1 else "")
        members.append((f"args/{i}.pickle", _dumps(call, what)))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members:
            info = zipfile.ZipInfo(name, _STAMP)
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return buf.getvalue()


def _cloudpickle_source() -> list[tuple[str, bytes]]:
    """The client's cloudpickle package, its Python files: the job unpickles with the same
    version that pickled (the two must agree)."""
    top = Path(cloudpickle.__file__).parent
    return [
        (f"cloudpickle/{p.relative_to(top).as_posix()}", p.read_bytes()) for p in sorted(top.rglob("*.py"))
    ]


def _dumps(value: object, what: str) -> bytes:
    try:
        data: bytes = cloudpickle.dumps(value)
    except Exception as exc:  # noqa: BLE001 - pickling raises anything its objects' __reduce__ raise
        raise BadArgument(
            f"{what} cannot be pickled to go to the job ({type(exc).__name__}: {exc}); pass what the "
            "job can rebuild instead (a path, a name, plain data)"
        ) from None
    return data


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


async def upload(client: PoolClient, data: bytes, label: str) -> dict[str, str]:
    """Store the archive `data` content-addressed; its entry in the job spec's `inputs`."""
    with tempfile.TemporaryDirectory(prefix="gpupool-") as scratch:
        path = Path(scratch) / ARCHIVE
        path.write_bytes(data)
        source = transfer.Source("file", path, hashlib.sha256(data).hexdigest(), len(data))
        ref, _ = await transfer.upload(client, source, None, label)
    return {"sha256": ref.sha256, "dest": ARCHIVE, "kind": "file"}


def argv(project: dict[str, Any] | None) -> list[str]:
    """The job's command: the environment's python on the archive, which lies at the top of the
    job's directory while the job starts in the project's `dir` within it."""
    depth = len([p for p in (project or {}).get("dir", "").split("/") if p])
    return ["python", "../" * depth + ARCHIVE]


def result_artifact(job: dict[str, Any]) -> dict[str, Any] | None:
    """The outcome's artifact in the record of a function's job (its key and recorded sha256),
    or None: a command's job has none, whatever files it left (what it wrote is never unpickled)."""
    if not is_function_job(job):
        return None
    for item in (job.get("result") or {}).get("artifacts") or []:
        if item.get("name") == RESULT:
            return dict(item)
    return None


def is_function_job(job: dict[str, Any]) -> bool:
    """Whether the job is one the API made for a function: its command is the runner's
    (`python ../ARCHIVE`, as `argv` makes it) on an archive that is its own input."""
    spec = job.get("spec") or {}
    args = spec.get("argv") or []
    ours = len(args) == 2 and args == argv(spec.get("project"))
    return ours and any(
        i.get("dest") == ARCHIVE and i.get("kind") == "file" and i.get("sha256")
        for i in spec.get("inputs") or []
    )


async def fetch(client: PoolClient, job: dict[str, Any], item: dict[str, Any]) -> bytes:
    """The outcome's bytes, downloaded and checked against the sha256 the worker recorded (a
    record without one is refused), here again after the download."""
    digest = transfer.recorded_sha256(item)
    with tempfile.TemporaryDirectory(prefix="gpupool-") as scratch:
        dest = Path(scratch) / "result.pickle"
        await transfer.download(client, item["key"], dest, f"the result of job {job['id']}", digest)
        data = dest.read_bytes()
    if hashlib.sha256(data).hexdigest() != digest:
        raise RemoteError(f"the result of job {job['id']} is not what its job stored (its sha256 differs)")
    return data


@dataclass(frozen=True)
class Fetched:
    """A job's outcome as its verified bytes, fetched on the API's loop and loaded (unpickled) in
    the thread that asks for it (`load`): an import that unpickling makes, or a class that only the
    job has, never blocks nor breaks the loop."""

    job_id: str
    state: str  # the job's, as its record says
    detail: str
    data: bytes = field(repr=False)

    def load(self) -> Any:
        """What the call returned; or the exception it raised, raised again with the job's
        traceback as its cause (RemoteError where the exception cannot be rebuilt here, or is not
        an Exception: a SystemExit raised here would end the caller; JobFailed when such a one
        is what a timeout or a cancel left)."""
        try:
            what, tb, inner = pickle.loads(self.data)  # noqa: S301 - the user's own job's, its sha256 checked
        except Exception as why:  # noqa: BLE001 - unpickling raises anything
            raise self._unloadable(why) from None
        if what == "returned":
            try:
                return cloudpickle.loads(inner)
            except Exception as why:  # noqa: BLE001 - a class only the job has, a CUDA tensor...
                raise self._unloadable(why) from None
        if what == "raised":
            try:
                exc = cloudpickle.loads(inner)
            except Exception as why:  # noqa: BLE001 - unpickling raises what a class's __setstate__ raises
                raise RemoteError(
                    f"the job raised an exception that cannot be rebuilt here ({why}):\n{tb}"
                ) from None
            if isinstance(exc, Exception):
                raise exc from RemoteTraceback(tb)
            if isinstance(exc, BaseException):  # SystemExit, KeyboardInterrupt: raised here, they
                # would end the caller's script (or interrupt it) for what ended the job
                if self.stopped:  # what the stop signal of a timeout or cancel raised in the job
                    raise JobFailed(self.job_id, self.state, self.detail, "") from RemoteTraceback(tb)
                raise RemoteError(f"the job raised {type(exc).__name__}: {exc}") from RemoteTraceback(tb)
        raise RemoteError(tb.rstrip())

    @property
    def stopped(self) -> bool:
        """Whether the pool stopped the job (a cancel, a timeout), as its record says."""
        return self.state == "cancelled" or self.detail.startswith("timed out")

    def _unloadable(self, why: Exception) -> RemoteError:
        return RemoteError(
            f"job {self.job_id} {self.state} but its result cannot be loaded here "
            f"({type(why).__name__}: {why}); job.artifacts(dest) downloads it as a file"
        )
