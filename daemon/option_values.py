"""An option's value: what it must be (an `Option` row: its type, range, choices and check), how a
raw value (TOML's, or the text of an env variable or a flag) becomes the typed one or a
`ConfigError` saying what was expected, and the parsers of the values no plain type describes (a
range of uids, an amount per queue), each a ValueError saying what is expected.

daemon/options.py is the table of every option, one `Option` row each; daemon/config.py merges the
layers into a `Config` through `convert`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from daemon.errors import ConfigError
from daemon.spec_checks import MEM_MIN

ROOT = "root"  # job_uid_range's value that runs jobs as root, by the operator's explicit choice


def uid_range_of(text: str) -> range:
    """`"FIRST-LAST"` (inclusive) as a range of uids; ValueError saying what is wrong."""
    first, sep, last = text.partition("-")
    if not sep or not first.strip().isdigit() or not last.strip().isdigit():
        raise ValueError("expected FIRST-LAST, e.g. 61000-61063")
    lo, hi = int(first), int(last)
    if not 1000 <= lo <= hi < 2**31:
        raise ValueError("expected 1000 <= FIRST <= LAST < 2**31, uids of no real user")
    return range(lo, hi + 1)


def job_uid_range_of(text: str) -> range | None:
    """A `job_uid_range` value: its uids, or None for "root"; ValueError saying what is wrong."""
    if text == ROOT:
        return None
    try:
        return uid_range_of(text)
    except ValueError as exc:
        raise ValueError(f'{exc}, or "root" to run jobs as root') from None


def queue_amounts(items: list[str], amount: Callable[[str], int]) -> dict[str, int]:
    """`["QUEUE=AMOUNT", ...]` (a per-queue default) as {queue: amount}, each AMOUNT read by
    `amount`; ValueError saying what is wrong."""
    out: dict[str, int] = {}
    for item in items:
        queue, sep, text = str(item).partition("=")
        if not sep or not queue.strip():
            raise ValueError(f"{item!r}: expected QUEUE=AMOUNT, e.g. default=4")
        try:
            out[queue.strip()] = amount(text.strip())
        except ValueError as exc:
            raise ValueError(f"{item!r}: {exc}") from None
    return out


def _count(text: str) -> int:
    """A whole number, 1 or more."""
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{text!r} is not a whole number, 1 or more")
    return int(text)


def queue_cpus(items: list[str]) -> dict[str, int]:
    """`queue_default_cpus`: {queue: CPUs}."""
    return queue_amounts(items, _count)


def _mem(text: str) -> int:
    """Bytes of a job's memory: a MiB at least (4096 is 4096 bytes, a job killed at once)."""
    size = _count(text)
    if size < MEM_MIN:
        raise ValueError(
            f"{text!r} is {size} bytes, less than a MiB: bytes, e.g. {size * MEM_MIN} for {size} MiB"
        )
    return size


def queue_mem(items: list[str]) -> dict[str, int]:
    """`queue_default_mem`: {queue: bytes}, in bytes as the other sizes of the config are."""
    return queue_amounts(items, _mem)


@dataclass(frozen=True, slots=True)
class Option:
    name: str
    type: type
    default: Any
    help: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    secret: bool = False
    check: Callable[[Any], object] | None = None  # extra validation of a value of the type

    def expected(self) -> str:
        if self.choices:
            return "one of " + ", ".join(self.choices)
        kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
            self.type, "a list of names"
        )
        if self.lo is not None and self.hi is not None:
            return f"{kind} from {self.lo:g} to {self.hi:g}"
        if self.lo is not None:
            return f"{kind} >= {self.lo:g}"
        return kind


def convert(option: Option, raw: Any, source: str, is_text: bool) -> Any:
    """The typed value of `raw`, or ConfigError saying what was expected."""
    value = _coerce(option, raw, is_text)
    if value is None or not _in_range(option, value):
        shown = "***" if option.secret else repr(raw)
        raise ConfigError(option.name, source, f"{shown} is not valid: expected {option.expected()}")
    if option.check is not None and value:
        try:
            option.check(value)
        except ValueError as exc:
            raise ConfigError(option.name, source, f"{raw!r} is not valid: {exc}") from None
    return value


def _coerce(option: Option, raw: Any, is_text: bool) -> Any:
    if option.type is list:
        value = [part.strip() for part in raw.split(",") if part.strip()] if is_text else raw
        ok = (
            isinstance(value, list)
            and (value or option.default == [])
            and all(isinstance(v, str) and v for v in value)
        )
        return value if ok else None
    if is_text and option.type is not str:
        return _parse_text(option.type, raw)
    if option.type is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    return raw if type(raw) is option.type else None


def _in_range(option: Option, value: Any) -> bool:
    if option.choices and value not in option.choices:
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (option.lo is None or value >= option.lo) and (option.hi is None or value <= option.hi)
    return True


def _parse_text(kind: type, text: str) -> Any:
    text = text.strip()
    if kind is bool:
        return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(
            text.lower()
        )
    try:
        return kind(text)
    except ValueError:
        return None
