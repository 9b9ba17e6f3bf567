"""What a listing shows of jobs, whatever their users put in them.

A listing (`poolctl ls`, a live view, the dashboard's job list) holds many users' jobs at once: one
user's long fields must not make it too large to send or to draw for everyone else (issue 44
item 6: one user's names of 100 KiB made `ls --all` a 73 MB reply, over the frame limit, and the
dashboard's job list 70 MiB). So a listed record is cut, every string to FIELD_CHARS characters
and every list and map to LIST_ITEMS entries, and one that was cut says so ('shortened': true);
`poolctl show` and the job's own page still give it whole. A listing stops adding records once
they reach LIST_BYTES, well within one frame, whatever the row count asked for, and its last
record says how many more there were (MORE), which poolctl prints: a key in a record, which
clients that do not know it ignore, rather than a field of the reply, which every client must
send and read (protocol/replies.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase
from typing import Any

import msgpack

FIELD_CHARS = 256  # of one string: a name, an argument, a path
ELLIPSIS = "…"
LIST_ITEMS = 32  # of one list or map: arguments, variables, inputs, attempts
LIST_BYTES = 8 * 2**20  # of a listing's records, encoded: half a frame (protocol DEFAULT_MAX_FRAME_SIZE)
SHORTENED = "shortened"  # the key that marks a record cut for a listing
MORE = "more_not_shown"  # the key on a listing's last record: how many records were left out


def shown_name(name: str, argv: Sequence[str]) -> str:
    """What a listing names a job by: its --name, or its command where it has none."""
    return name or " ".join(argv)


def selected(owner: str, name: str, argv: Sequence[str], user: str | None, pattern: str | None) -> bool:
    """Whether a job of `owner`'s, named `name` and running `argv`, is among those a listing asks
    for: `user`'s (None: anyone's) whose shown name matches the glob `pattern` (None: any), the
    name being what `ls` names the job by (shown_name: its command whole, where ls cuts it)."""
    return (user is None or owner == user) and (
        pattern is None or fnmatchcase(shown_name(name, argv), pattern)
    )


def cut(text: str, most: int = FIELD_CHARS) -> str:
    """`text`, or its first `most` - 1 characters and an ellipsis where it is longer."""
    return text if len(text) <= most else text[: most - 1] + ELLIPSIS


def _shorten(value: Any, was_cut: list[bool]) -> Any:
    if isinstance(value, str):
        if len(value) > FIELD_CHARS:
            was_cut[0] = True
            return cut(value)
        return value
    if isinstance(value, bytes):
        if len(value) > FIELD_CHARS:
            was_cut[0] = True
            return value[:FIELD_CHARS]
        return value
    if isinstance(value, dict):
        if len(value) > LIST_ITEMS:
            was_cut[0] = True
        items = list(value.items())[:LIST_ITEMS]
        return {_shorten(k, was_cut): _shorten(v, was_cut) for k, v in items}
    if isinstance(value, list | tuple):
        if len(value) > LIST_ITEMS:
            was_cut[0] = True
        return [_shorten(v, was_cut) for v in value[:LIST_ITEMS]]
    return value


def shortened(record: dict[str, Any]) -> dict[str, Any]:
    """`record` as a listing shows it: each string at most FIELD_CHARS characters (ending in an
    ellipsis where cut), each list and map at most LIST_ITEMS entries, and marked 'shortened'
    where anything was cut. The record itself is left as it is."""
    was_cut = [False]
    out: dict[str, Any] = _shorten(record, was_cut)
    if was_cut[0]:
        out[SHORTENED] = True
    return out


def within_bytes(records: Iterable[dict[str, Any]], most: int = LIST_BYTES) -> list[dict[str, Any]]:
    """The first of `records` whose encoded sizes together stay within `most` bytes, the last of
    them marked with how many were left out (MORE), where any were."""
    out: list[dict[str, Any]] = []
    total, left_out = 0, 0
    for record in records:
        if left_out or (total := total + len(msgpack.packb(record))) > most:
            left_out += 1  # (counted, not encoded)
        else:
            out.append(record)
    if left_out and out:
        out[-1] = {**out[-1], MORE: left_out}
    return out
