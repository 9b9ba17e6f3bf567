"""`poolctl enqueue --array 0-99%8` and `--sweep lr=1e-3,3e-4 --sweep bs=32,64`: one job spec per
index and per point of the sweep's cartesian product, all of one array ("QUEUE@ID"), sent in one
batch. Each job finds its index in $GPUPOOL_ARRAY_INDEX (the worker sets it) and its point's
values in its environment (`lr=3e-4`), and `{lr}` in the command is replaced by the value. `%8`:
at most 8 of the array are under way at once, as Slurm's %N: the rest wait, and as one ends the next
by index goes in (the queue's scripts keep the count: daemon/queue/lua/_lib.lua, arrays).
"""

from __future__ import annotations

import itertools
import re
import secrets
from collections.abc import Sequence
from typing import Any

MAX_JOBS = 10_000  # one batch (the server's admission.MAX_BATCH)
MAX_INDEX = 2**31  # the job model's bound on $GPUPOOL_ARRAY_INDEX (daemon/spec_checks.py array_index)
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ArrayError(ValueError):
    """An --array or --sweep that cannot be read: the sentence says what and how to write it."""


def parse_array(text: str) -> tuple[list[int], int]:
    """ "0-99%8", "1,3,5-7": the indices, in order, and the most to run at once (0: no limit)."""
    spec, _, limit = text.partition("%")
    indices: list[int] = []
    for part in spec.split(","):
        m = _RANGE.fullmatch(part.strip())
        if m is None:
            raise ArrayError(f"--array {text!r}: write indices as 0-99, 1,3,5-7 or 0-99%8")
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if hi < lo:
            raise ArrayError(f"--array {text!r}: {part} runs backwards")
        if hi > MAX_INDEX:
            raise ArrayError(f"--array {text!r}: an index is at most {MAX_INDEX}")
        if len(indices) + hi - lo + 1 > MAX_JOBS:  # counted before the range is made: 0-1000000000
            raise ArrayError(f"--array {text!r}: at most {MAX_JOBS} jobs in one array")
        indices += range(lo, hi + 1)
    if limit and (not limit.isdigit() or not 1 <= int(limit) <= MAX_JOBS):
        raise ArrayError(
            f"--array {text!r}: %N is the most to run at once, a whole number from 1 to {MAX_JOBS}"
        )
    if len(set(indices)) != len(indices):
        raise ArrayError(f"--array {text!r}: an index is given twice")
    return indices, int(limit or 0)


def parse_sweep(items: Sequence[str]) -> list[dict[str, str]]:
    """["lr=1e-3,3e-4", "bs=32,64"]: every combination, the first key varying slowest."""
    keys: list[str] = []
    values: list[list[str]] = []
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or _KEY.fullmatch(key) is None or not text:
            raise ArrayError(f"--sweep {item!r}: write NAME=V1,V2,... (NAME a variable name)")
        if key in keys:
            raise ArrayError(f"--sweep {key} is given twice: give its values in one --sweep")
        keys.append(key)
        values.append(text.split(","))
    points = [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]
    if len(points) > MAX_JOBS:
        raise ArrayError(f"--sweep makes {len(points)} jobs; at most {MAX_JOBS} in one array")
    return points


def array_specs(
    base: dict[str, Any], indices: Sequence[int] | None, points: Sequence[dict[str, str]], limit: int
) -> tuple[str, list[dict[str, Any]]]:
    """The array's id and its jobs' specs: `base` once per index (or once, without --array) and
    sweep point (or once, without --sweep), in that order."""
    array_id = f"{base.get('queue', 'default')}@{secrets.token_hex(6)}"
    specs = []
    for pos, (index, point) in enumerate(itertools.product(indices or [0], points or [{}])):
        if pos >= MAX_JOBS:
            raise ArrayError(f"--array with --sweep makes more than {MAX_JOBS} jobs in one array")
        spec = dict(base)
        spec["argv"] = [_fill(arg, point) for arg in base["argv"]]
        spec["env"] = {**(base.get("env") or {}), **point}
        spec.update(array=array_id, array_index=index, array_pos=pos, array_limit=limit)
        specs.append(spec)
    return array_id, specs


def _fill(arg: str, point: dict[str, str]) -> str:
    for key, value in point.items():
        arg = arg.replace("{" + key + "}", value)
    return arg


def partly_queued(array_id: str) -> str:
    """What to say of an array whose batch failed once sent: some of its jobs may be queued, and
    its id finds them (the enqueue scripts record it with each job)."""
    return (
        f"array {array_id} may be partly queued: 'poolctl show {array_id}' says what is, "
        f"'poolctl cancel {array_id}' cancels it"
    )
