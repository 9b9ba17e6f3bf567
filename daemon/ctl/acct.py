"""`poolctl acct`: who used what, from the pool's accounting records (issue 50), like Slurm's sreport.

It parses the span and the grouping, asks the server (an Account request; the server reads and
sums the records: daemon/server/accounting.py), and prints the rows: a table, --json or --csv.
"""

from __future__ import annotations

import argparse
import calendar
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from daemon.ctl import render
from protocol import Account, Accounted

BY = ("user", "queue", "day")
_AGO = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DATES = ("%Y-%m-%d", "%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d %H:%M:%S")
WHEN_HELP = "a time back from now (30d, 12h, 2w) or a UTC date (2026-11-01, 2026-11-01T08:00)"


def when(text: str, now: Callable[[], float] = time.time) -> float:
    """An argparse type: Unix time of `text`, a span back from now or a UTC date (WHEN_HELP)."""
    if m := _AGO.fullmatch(text.strip()):
        return now() - float(m.group(1)) * _UNIT[m.group(2)]
    for layout in _DATES:
        try:
            return float(calendar.timegm(time.strptime(text.strip(), layout)))
        except ValueError:
            continue
    raise argparse.ArgumentTypeError(f"expected {WHEN_HELP}, not {text!r}")


def grouping(text: str) -> str:
    """An argparse type: what to sum per, one of BY."""
    if text not in BY:
        raise argparse.ArgumentTypeError(
            f"sums per user, queue or day, not {text!r}: give --by user, queue or day"
        )
    return text


def add_acct(sub: Any) -> None:  # argparse's _SubParsersAction
    acct = sub.add_parser(
        "acct",
        help="what the jobs that ended used: jobs, GPU- and CPU-hours, efficiency, waits, failures "
        "(your own; a pool admin's, everyone's)",
    )
    acct.add_argument("--user", "-u", metavar="USER", help="only USER's jobs (an admin may name anyone)")
    acct.add_argument("--queue", "-q", metavar="QUEUE", help="only the jobs of QUEUE")
    acct.add_argument(
        "--since", "-S", type=when, metavar="WHEN", help=f"from WHEN, {WHEN_HELP} (default 30d)"
    )
    acct.add_argument("--until", "-E", type=when, metavar="WHEN", help="up to WHEN, as --since (default now)")
    acct.add_argument(
        "--by", type=grouping, default="user", metavar="user|queue|day", help="sum per (default user)"
    )
    shown = acct.add_mutually_exclusive_group()
    shown.add_argument(
        "--json", action="store_true", help="one JSON object: the rows, the total and the span"
    )
    shown.add_argument("--csv", action="store_true", help="the rows as CSV, a header first")


def request(args: argparse.Namespace) -> Account:
    return Account(args.user, args.queue, args.since, args.until, args.by)


HEADERS = ("JOBS", "FAILED", "CANCELLED", "GPU-HOURS", "CPU-HOURS", "EFFICIENCY", "WAIT-P50", "WAIT-P90")
FIELDS = ("jobs", "failed", "cancelled", "gpu_hours", "cpu_hours", "efficiency", "wait_p50", "wait_p90")


def _cells(row: dict[str, Any]) -> list[str]:
    eff = row.get("efficiency")
    return [
        str(row["jobs"]),
        str(row["failed"]),
        str(row["cancelled"]),
        f"{row['gpu_hours']:.2f}",
        f"{row['cpu_hours']:.2f}",
        "-" if eff is None else f"{eff:.0%}",
        render.duration(row.get("wait_p50")),
        render.duration(row.get("wait_p90")),
    ]


def show(reply: Accounted, by: str, *, as_json: bool, as_csv: bool) -> None:
    if as_json:
        print(
            render.json_text(
                {
                    "by": by,
                    "since": reply.since,
                    "until": reply.until,
                    "rows": reply.rows,
                    "total": reply.total,
                }
            )
        )
        return
    if as_csv:
        import csv

        out = csv.writer(sys.stdout, lineterminator="\n")
        out.writerow([by, *FIELDS])
        for row in reply.rows:
            out.writerow([render.clean(row[by]), *("" if row.get(f) is None else row[f] for f in FIELDS)])
        return
    if not reply.rows:
        print("no jobs ended in that span (for what you may see)")
        return
    rows = [[str(row[by]), *_cells(row)] for row in reply.rows]
    if len(rows) > 1:
        rows.append(["total", *_cells(reply.total)])
    render.table(render.Rows([by.upper(), *HEADERS], rows))
