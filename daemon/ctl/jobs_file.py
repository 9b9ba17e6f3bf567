"""What `poolctl enqueue --from-file` reads: a job spec (a JSON object) a line, blank lines
skipped. A line that is not one, or too large to send, is named FILE:LINE, as a compiler names
the line of a mistake, so that a file of ten thousand jobs is mended where it is wrong.

Each spec is checked here by the job model the server checks it with (daemon/job.py), since the
server refuses a batch whole, without saying which of its jobs was wrong; the server still
checks every spec, and what only it knows (the pool's bounds and queues, the user's ceiling).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from daemon.client.session import mib
from daemon.errors import GpupoolError, InvalidJob
from daemon.job import JobSpec
from protocol import DEFAULT_MAX_FRAME_SIZE, ErrorCode

# The most one request carries by default (the server's max_frame_size; a spec is bounded far lower, by
# job_spec_max_bytes): a line larger is no job spec a pool takes, whatever else the file holds.
MAX_LINE_BYTES = DEFAULT_MAX_FRAME_SIZE


_JSON_NAMES = {
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "true or false",
    type(None): "null",
}


class JobsFileError(GpupoolError):
    """The file cannot be read, or one of its lines is no job spec; exits 2, as a usage error."""

    code = ErrorCode.INVALID_ARGUMENT


def read_jobs(path: str) -> list[dict[str, Any]]:
    """The job specs in the file at `path`, in order; JobsFileError naming FILE:LINE for the first
    line that is not one."""
    try:
        with Path(path).open("rb") as f:
            specs = [_spec(path, number, line) for number, line in enumerate(f, 1)]
    except OSError as exc:
        raise JobsFileError(f"cannot read jobs from {path}: {exc.strerror}") from None
    return [spec for spec in specs if spec is not None]


def _spec(path: str, number: int, line: bytes) -> dict[str, Any] | None:
    """The job spec on line `number`; None for a blank line."""
    if not line.strip():
        return None
    if len(line) > MAX_LINE_BYTES:
        raise JobsFileError(
            f"{path}:{number}: a job spec of {mib(len(line))}, more than the {mib(MAX_LINE_BYTES)} "
            "one request carries (and a pool takes a spec of at most its job_spec_max_bytes, 64 KiB "
            "unless its operator set more): put large data in a file the job reads, with --input"
        )
    try:
        spec = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise JobsFileError(
            f"{path}:{number}: not JSON ({exc.msg} at column {exc.colno}): each line must be a job "
            "spec, a JSON object"
        ) from None
    if not isinstance(spec, dict):
        raise JobsFileError(
            f"{path}:{number}: a JSON {_JSON_NAMES.get(type(spec), 'value')}, not an object: each "
            "line must be a job spec, a JSON object"
        )
    try:
        JobSpec.from_dict(spec)  # the server's own check of each spec, run here to name the line
    except InvalidJob as exc:
        raise JobsFileError(f"{path}:{number}: {exc}") from None
    return spec
