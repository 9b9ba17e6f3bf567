"""How poolctl prints: rich tables on a terminal, plain aligned text otherwise, JSON on request.

Everything in a job's record may come from another user (a job's name, its command, a worker's
host), so every field is printed through `clean`: control characters (escape sequences that could
move the cursor, rewrite the screen or set the window title) and the Unicode marks that reorder
text are shown as escapes, and on a terminal nothing is read as rich markup.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from protocol.record import Record

if TYPE_CHECKING:
    from rich.table import Table

# C0 and C1 controls, DEL, the line and paragraph separators, and the bidirectional and zero-width
# marks (U+061C, U+200B-U+200F, U+2028-U+202E, U+2066-U+2069, U+FEFF)
_HOSTILE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2066-\u2069\ufeff]")


def clean(text: object) -> str:
    """`text` as it may be printed: every hostile character as a visible escape (\\x1b, \\u202e)."""
    return _HOSTILE.sub(
        lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}",
        str(text),
    )


STATE_STYLE = {
    "queued": "yellow",
    "running": "cyan",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "magenta",
    "dead": "bold red",
    "healthy": "green",
    "draining": "yellow",
    "late": "bold yellow",  # a worker whose heartbeats stopped: dead if they do not come back
}


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


class Rows(Record):
    """A table to print: its column headers, its rows of cells, and which column is a state."""

    headers: Sequence[str]
    rows: Sequence[Sequence[str]]
    state_col: int | None = None


def rich_table(table: Rows, title: str | None = None) -> Table:
    """`table` as rich draws it on a terminal: every cell cleaned and never read as markup."""
    from rich.markup import escape
    from rich.table import Table

    drawn = Table(*table.headers, box=None, header_style="bold", pad_edge=False, title=title)
    drawn.title_justify = "left"
    for row in table.rows:
        cells = [escape(clean(cell)) for cell in row]
        if table.state_col is not None and (style := STATE_STYLE.get(row[table.state_col])):
            cells[table.state_col] = f"[{style}]{cells[table.state_col]}[/]"
        drawn.add_row(*cells)
    return drawn


def width(text: str) -> int:
    """The columns `text` takes on a terminal: two for a wide character (CJK, most emoji), none for
    a combining mark, as rich measures them. ASCII is one a character, and spares importing rich."""
    if text.isascii():
        return len(text)
    from rich.cells import cell_len

    return cell_len(text)


def plain_lines(table: Rows, header: bool = True) -> list[str]:
    """`table` as aligned text, for a pipe: each column as wide as its widest cell shows."""
    rows = [[clean(cell) for cell in row] for row in table.rows]
    headers = list(table.headers)
    widths = [max([width(h) if header else 0, *(width(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    return [
        "  ".join(cell + " " * (w - width(cell)) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in ([headers, *rows] if header else rows)
    ]


def _table(table: Rows, header: bool = True) -> None:
    if sys.stdout.isatty() and header:  # rich only then: importing it is a large part of a command's start
        from rich.console import Console

        Console().print(rich_table(table))
        return
    for line in plain_lines(table, header):
        print(line)


def table(rows: Rows) -> None:
    """`rows` as a table: drawn by rich on a terminal, aligned text otherwise."""
    _table(rows)


def json_text(value: object) -> str:
    """`value` as one line of JSON (what --json prints, a line per item)."""
    import orjson

    return orjson.dumps(value).decode()


def _json_lines(items: Sequence[dict[str, Any]]) -> None:
    for item in items:
        sys.stdout.write(json_text(item) + "\n")


JOB_COLUMNS = (
    *("id", "name", "user", "queue", "state", "attempt", "worker", "waited", "ran"),  # ls's own
    *("index", "gpus", "priority", "exit", "reason"),  # for --format (INDEX: ls's, given an array)
)  # REASON: why a queued job waits (as show says it), or why one ended
SHOWN = JOB_COLUMNS.index("ran") + 1  # the columns ls prints by default
INDEX = JOB_COLUMNS.index("index")
NAME_CHARS = 40  # of a command shown as a job's name: its start and its end, an ellipsis between


def columns(text: str) -> list[int]:
    """`--format id,state` as indices into JOB_COLUMNS; ValueError names one not among them."""
    chosen = []
    for name in (part.strip().lower() for part in text.split(",")):
        if name not in JOB_COLUMNS:
            raise ValueError(f"--format: no column {name!r}; the columns are {', '.join(JOB_COLUMNS)}")
        chosen.append(JOB_COLUMNS.index(name))
    return chosen


def jobs(
    items: Sequence[dict[str, Any]],
    *,
    as_json: bool,
    columns: Sequence[int] | None = None,
    header: bool = True,
) -> None:
    if as_json:
        _json_lines(items)
        return
    _table(job_rows(items, columns), header=header)


def middle_cut(text: str, most: int = NAME_CHARS) -> str:
    """`text`, or its start and its end with an ellipsis between where it is longer than `most`:
    an array's or a sweep's commands differ at their ends (`train.py --lr 3e-4`)."""
    if len(text) <= most:
        return text
    head = (most - 1) // 2
    return text[:head] + "…" + text[len(text) - (most - 1 - head) :]


def _name(spec: dict[str, Any]) -> str:
    """The NAME column: the job's name, or its command (cut in its middle)."""
    return spec["name"] or middle_cut(" ".join(spec["argv"]))


def _gpus_asked(spec: dict[str, Any]) -> str:
    """The GPUS column: how many, or the memory of a shared one (--gpu-mem)."""
    return f"{_whole(size(spec['gpu_mem']))} shared" if spec.get("gpu_mem") else str(spec["gpus"])


def job_rows(items: Sequence[dict[str, Any]], columns: Sequence[int] | None = None) -> Rows:
    """Jobs as `ls` shows them, in the `columns` asked for: by default the first SHOWN of
    JOB_COLUMNS, and INDEX after ID where any is of an array (its tasks told apart)."""
    now = time.time()
    rows = []
    for j in items:
        spec = j["spec"]
        started, ended = j["started_at"], j["ended_at"]
        waited = (started or (None if ended else now)) and ((started or now) - j["enqueued_at"])
        ran = started and ((ended or now) - started)
        rows.append(
            [
                j["id"],
                _name(spec),
                spec["user"],
                spec["queue"],
                j["state"],
                str(j["attempt"]),
                j["worker"] or "-",
                duration(waited),
                duration(ran),
                str(spec["array_index"]) if spec.get("array") else "-",
                _gpus_asked(spec),
                str(spec.get("priority") or 0),
                "-" if j["exit_code"] is None else str(j["exit_code"]),
                j.get("pending_reason") or j["detail"] or "-",
            ]
        )
    if columns is None:
        arrays = any(j["spec"].get("array") for j in items)
        columns = [0, *([INDEX] if arrays else []), *range(1, SHOWN)]
    picked = list(columns)
    headers = [JOB_COLUMNS[i].upper() for i in picked]
    state = picked.index(4) if 4 in picked else None
    return Rows(headers, [[row[i] for i in picked] for row in rows], state)


def size(n: int) -> str:
    """Bytes for humans: 512 B, 1.5 KiB, 3.2 GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _whole(text: str) -> str:
    """`20 GiB` for `20.0 GiB`: a size asked for in whole units is shown as it was asked."""
    return text.replace(".0 ", " ")


def project_text(project: dict[str, Any] | None) -> str | None:
    """`3f2a1b9c0d4e of commit 9c1e0f2a7b3d + uncommitted changes, 120 files, 1.2 MiB, started in
    src`: which snapshot of its project a job ran (its id), and what that held."""
    if not project:
        return None
    commit = project.get("commit") or ""
    origin = f"of commit {commit[:12]}" + (" + uncommitted changes" if project.get("dirty") else "")
    return (
        f"{project.get('id', '')[:12]} {origin if commit else '(not in git)'}, "
        f"{project.get('files', 0)} files, {size(int(project.get('size', 0)))}"
        + (f", started in {project['dir']}" if project.get("dir") else "")
    )


def _data_lines(spec: dict[str, Any]) -> list[tuple[str, str | None]]:
    snap = spec.get("snapshot")
    inputs = spec.get("inputs") or []
    return [
        ("project", project_text(spec.get("project"))),
        (
            "snapshot",
            snap
            and f"{snap.get('sha256', '')[:12] or '(hidden)'} of commit {snap['commit'][:12] or '(none)'}"
            + (" + uncommitted changes" if snap.get("dirty") else ""),
        ),
        (
            "inputs",
            ", ".join(f"{i['dest']} ({i['kind']} {i.get('sha256', '(hidden)')[:12]})" for i in inputs)
            or None,
        ),
    ]


def _artifacts(result: dict[str, Any]) -> None:
    items = result.get("artifacts") or []
    if items or result.get("log"):
        print("artifacts:")
        for a in items:
            print(f"  {size(a['size']):>10}  {clean(a['name'])}")
        if result.get("log"):
            print(f"  {size(result['log']['size']):>10}  (log)")
    for error in result.get("artifact_errors") or []:
        print(f"  not uploaded: {clean(error)}")


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def job(j: dict[str, Any], *, as_json: bool) -> None:
    import shlex  # only show asks

    if as_json:
        _json_lines([j])
        return
    if "array" in j:  # an array's id: its jobs by state
        by_state = ", ".join(f"{n} {state}" for state, n in sorted(j["array"]["states"].items()))
        print(f"{'id':<10} {j['id']}\n{'jobs':<10} {j['array']['jobs']}: {by_state}")
        return
    spec = j["spec"]
    lines = [
        ("id", j["id"]),
        ("state", j["state"] + (" (cancel requested)" if j["cancel_requested"] else "")),
        ("pending", j.get("pending_reason")),
        ("name", spec["name"] or None),
        ("user", spec["user"]),
        ("queue", spec["queue"]),
        ("command", shlex.join(spec["argv"])),  # as a shell takes it back: quoted where it must be
        ("gpus", None if spec.get("gpu_mem") else str(spec["gpus"])),
        ("gpu mem", f"{_whole(size(spec['gpu_mem']))} on a shared GPU" if spec.get("gpu_mem") else None),
        ("cpus", str(spec["cpus"]) if spec.get("cpus") else None),
        ("mem", _whole(size(spec["mem"])) if spec.get("mem") else None),
        ("priority", str(spec["priority"]) if spec.get("priority") else None),
        ("cwd", spec["cwd"]),
        ("env", " ".join(f"{k}={v}" for k, v in spec["env"].items()) or None),
        *_data_lines(spec),
        ("timeout", f"{spec['timeout']:g} s" if spec["timeout"] else None),
        (
            "attempt",
            f"{j['attempt']} (max {spec['max_attempts']} lost, {spec['retries']} retries on failure)",
        ),
        ("worker", j["worker"] or None),
        ("enqueued", _when(j["enqueued_at"])),
        ("started", _when(j["started_at"])),
        ("ended", _when(j["ended_at"])),
        ("exit code", None if j["exit_code"] is None else str(j["exit_code"])),
        ("detail", j["detail"] or None),
        ("gpu usage", gpu_usage(j.get("gpu_usage"))),
        ("gpu idle", gpu_idle(j.get("idle_gpu"))),
    ]
    for key, value in lines:
        if value is not None:
            print(f"{key + ':':<11}{clean(value)}")
    if j["attempts"]:
        print("attempts:")
        for a in j["attempts"]:
            ran = duration((a["ended_at"] or time.time()) - a["started_at"])
            started = _when(a["started_at"])
            print(f"  #{a['attempt']}  {a['how']:<10} on {clean(a['worker'])}  started {started}  ran {ran}")
    _artifacts(j.get("result") or {})


def gpu_usage(usage: dict[str, Any] | None) -> str | None:
    """A job's `gpu_usage` in a line: `48 % mean, 85 % p95, peak 10 GiB, 1.2 Wh, efficiency 49 %
    (2 GPUs, 40 readings)`; None without one (no GPUs, or not ended yet)."""
    if not usage:
        return None
    parts = []
    if usage.get("util_mean") is not None:
        parts.append(f"{usage['util_mean']:.0f} % mean, {usage['util_p95']:.0f} % p95")
    if usage.get("mem_peak") is not None:
        parts.append(f"peak {_whole(size(int(usage['mem_peak'])))}")
    if usage.get("energy_j") is not None:
        parts.append(f"{usage['energy_j'] / 3600:.3g} Wh")
    if usage.get("efficiency") is not None:
        parts.append(f"efficiency {usage['efficiency'] * 100:.0f} %")
    gpus = len(usage.get("gpus") or [])
    return f"{', '.join(parts) or 'no readings'} ({gpus} GPUs, {usage.get('samples', 0)} readings)"


def gpu_idle(idle: dict[str, Any] | None) -> str | None:
    """A job's `idle_gpu` flag in a line: `below 5 % for 30 min (attempt 1); requeued`."""
    if not idle:
        return None
    done = {"requeue": "; requeued", "cancel": "; cancelled"}.get(str(idle.get("action")), "")
    return f"below {idle['util_below']:g} % for {idle['minutes']:.1f} min (attempt {idle['attempt']}){done}"


def _gpus(gpus: Sequence[dict[str, Any]]) -> str:
    """`2x NVIDIA H100 (80 GiB), 1 busy, 1 shared by 3 jobs`: the kinds of GPUs, how many run a job
    of their own now, and how many are shared by --gpu-mem jobs (and by how many jobs in all)."""
    if not gpus:
        return "cpu only"
    kinds: dict[str, int] = {}
    for g in gpus:
        label = f"{g.get('name', '?')} ({int(g.get('memory', 0)) / 2**30:.0f} GiB)"
        kinds[label] = kinds.get(label, 0) + 1
    text = ", ".join(f"{n}x {label}" for label, n in kinds.items())
    busy = sum(1 for g in gpus if g.get("job"))
    shared = [len(g["shared"]) for g in gpus if g.get("shared")]
    text += f", {busy} busy" if busy else ""
    return text + (f", {len(shared)} shared by {sum(shared)} jobs" if shared else "")


NO_WORKERS = "no workers have registered with this pool"


def workers(items: Sequence[dict[str, Any]], *, as_json: bool) -> None:
    if as_json:
        _json_lines(items)
        return
    if not items:
        print(NO_WORKERS)
        return
    _table(worker_rows(items))


def worker_rows(items: Sequence[dict[str, Any]]) -> Rows:
    """Workers as `poolctl workers` shows them; a PILOT column when one is a pilot (its batch job,
    and when it must leave, by this machine's clock); a SERVES column when one runs the jobs of one
    pool user only (a worker not running as root: worker_serve_user)."""
    pilots = any(w.get("batch_job") or w.get("leave_by") for w in items)
    serving = any(w.get("serves") for w in items)
    rows = []
    for w in items:
        gpus = w.get("gpus") or []
        quarantined = [g for g in gpus if g.get("quarantined")]
        rows.append(
            [
                w.get("id", "?"),
                w.get("host", "?"),
                w.get("health", "?"),
                f"{w.get('running', 0)}/{w.get('slots', 0)}",
                _gpus(gpus),
                ", ".join(f"GPU {g.get('index')}: {g['quarantined']}" for g in quarantined) or "-",
                duration(w.get("last_heartbeat_age")) + " ago",
                str(w.get("version", "")),
                *([pilot(w)] if pilots else []),
                *([str(w.get("serves") or "") or "(all)"] if serving else []),
            ]
        )
    headers = ["WORKER", "HOST", "STATE", "SLOTS", "GPUS", "QUARANTINED", "HEARTBEAT", "VERSION"]
    return Rows([*headers, *(["PILOT"] if pilots else []), *(["SERVES"] if serving else [])], rows, 2)


def pilot(worker: dict[str, Any]) -> str:
    """A pilot worker's batch job and leave-by time: `slurm:1234, leaves 14:03 (in 58m12s)`."""
    job = str(worker.get("batch_job") or "") or "-"
    leave_by = float(worker.get("leave_by") or 0)
    if not leave_by:
        return job
    at = time.strftime(
        "%H:%M" if abs(leave_by - time.time()) < 86400 else "%m-%d %H:%M", time.localtime(leave_by)
    )
    return f"{job}, leaves {at} (in {duration(leave_by - time.time())})"
