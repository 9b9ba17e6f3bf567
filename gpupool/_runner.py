"""The in-job runner: the `__main__.py` of the archive a function's job runs (`python ARCHIVE`).

It imports nothing of gpupool, so that the job's environment needs nothing of it installed: the
archive carries the client's own cloudpickle beside this file, the pickled function (fn.pickle)
and its arguments (args/INDEX.pickle: INDEX is $GPUPOOL_ARRAY_INDEX in an array's job, else 0).
The job's working directory goes on sys.path as `python -m` puts it, right behind the archive
(which holds no module but cloudpickle), so the project's own modules import as they do on the
client. Both pickles are loaded with the standard pickle, which imports cloudpickle only where one
needs it (a function pickled by value). What the call returned, or the exception it raised with
its formatted traceback, is written to $GPUPOOL_OUTPUT/gpupool/result.pickle, which comes back as
one of the job's artifacts; the exit status is 0 when it returned and 1 when it raised.

The file is an outer pickle of plain values, (what, traceback text, inner bytes), so that the
client can read what happened even where the inner pickle (the value, the exception) cannot be
loaded there. `what` is "returned", "raised", or "raised-text" (an exception, or a value, that
could not be pickled: its description is in the traceback text).
"""

from __future__ import annotations

import os
import pickle
import sys
import zipimport

RESULT = "gpupool/result.pickle"  # under $GPUPOOL_OUTPUT: the artifact's name (shipping.py)
Outcome = tuple[str, str, bytes]


def _call(archive: str) -> object:
    index = int(os.environ.get("GPUPOOL_ARRAY_INDEX") or 0)
    # Read by zipimport, which loaded this file (its index of the archive is kept): no zipfile
    # (or traceback, or typing) is imported on a call's way, as a small job's time is mostly
    # its imports.
    archived = zipimport.zipimporter(archive)
    fn_bytes = archived.get_data(os.path.join(archive, "fn.pickle"))
    args_bytes = archived.get_data(os.path.join(archive, "args", f"{index}.pickle"))
    sys.path.insert(1, os.getcwd())  # behind the archive, which holds no module but cloudpickle
    # The user's own call, from their own client: this job is theirs alone (shipping.py says why).
    fn = pickle.loads(fn_bytes)  # noqa: S301 - cloudpickle's: it imports cloudpickle where it must
    args, kwargs = pickle.loads(args_bytes)  # noqa: S301
    return fn(*args, **kwargs)


def _dumps(value: object) -> bytes:
    """`value` pickled: by the standard pickle where it can (cloudpickle takes a while to import,
    longer than a small job's call), by cloudpickle where it cannot (a class made in the job)."""
    try:
        return pickle.dumps(value, protocol=4)
    except Exception:  # noqa: BLE001 - pickling raises what a __reduce__ raises
        import cloudpickle  # the client's own, from the archive (sys.path[0])

        data: bytes = cloudpickle.dumps(value, protocol=4)
        return data


def _outcome(archive: str) -> tuple[int, Outcome]:
    try:
        value = _call(archive)
    except BaseException as exc:  # noqa: BLE001 - what ended the call comes back, SystemExit too
        import traceback

        tb = traceback.format_exc()
        traceback.print_exc()
        try:
            return 1, ("raised", tb, _dumps(exc))
        except Exception as why:  # noqa: BLE001 - one that cannot be pickled comes back as text
            said = f"{type(exc).__qualname__}: {exc} (it could not be pickled: {why})"
            return 1, ("raised-text", f"{said}\n{tb}", b"")
    try:
        return 0, ("returned", "", _dumps(value))
    except Exception as why:  # noqa: BLE001 - pickling raises what a __reduce__ raises
        said = f"the function returned a {type(value).__qualname__}, which could not be pickled: {why}"
        print(said, file=sys.stderr)
        import traceback

        return 1, ("raised-text", f"{said}\n{traceback.format_exc()}", b"")


def main() -> int:
    status, outcome = _outcome(sys.path[0])
    path = os.path.join(os.environ.get("GPUPOOL_OUTPUT") or ".", RESULT)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = path + ".part"
    with open(partial, "wb") as f:
        pickle.dump(outcome, f, protocol=4)
    os.replace(partial, path)
    sys.stdout.flush()
    sys.stderr.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
