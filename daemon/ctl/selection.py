"""`poolctl cancel --me --name 'sweep-*' --state queued`: cancel the jobs a selection picks, as
Slurm's `scancel -u/--name/--state` does.

The server lists what the selection picks (its filters: no one else's jobs are sent for it);
poolctl shows them and asks before it cancels them, on a terminal, or takes --yes; then cancels
them by id, so that exactly the jobs it showed are cancelled, never one queued meanwhile. The server
still decides each: only a job's owner or a pool admin may cancel it (docs/SECURITY.md), and a job
of another user's is left as it was and counted so. Without --user the selection is the caller's
own jobs: `cancel --state queued` never reaches for anyone else's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from daemon.ctl import render
from daemon.ctl.parsing import UsageError
from daemon.job import TERMINAL_STATES
from daemon.listing import MORE
from protocol import CancelJobs, Cancelled, ListJobs

MOST_JOBS = 10_000  # one selection: the most a listing holds (the server's MAX_LIST, and MAX_IDS)
CANCELLED = ("cancelled", "cancelling")  # a cancel's answers for a job it stopped or is stopping


def request(args: argparse.Namespace, me: str) -> ListJobs:
    """The listing of what `cancel`'s options select: the active jobs (queued, running), of the
    caller unless --user names another."""

    if args.state in TERMINAL_STATES:
        raise UsageError(
            f"--state {args.state}: those jobs have ended; cancel selects queued or running jobs"
        )
    return ListJobs(None, args.state, False, MOST_JOBS, args.user or me, args.name)


def described(args: argparse.Namespace, me: str) -> str:
    """The selection in words: `your queued jobs named 'sweep-*'`."""
    whose = "your" if (args.user or me) == me else f"{args.user}'s"
    named = f" named {args.name!r}" if args.name else ""
    return f"{whose} {args.state + ' ' if args.state else ''}jobs{named}"


def cancel(
    jobs: list[dict[str, Any]],
    what: str,
    args: argparse.Namespace,
    cancel_ids: Callable[[CancelJobs], Cancelled],
) -> int:
    """Cancel `jobs` (`what` the selection says in words) once the user agrees: a line per job as
    `cancel JOB` prints, and on stderr how many it cancelled. Exit status: 0, or EXIT_NOT_YOURS
    where some were another user's, EXIT_USAGE where nobody could be asked."""
    from daemon.ctl.cli import EXIT_NOT_YOURS

    if not jobs:
        print(f"poolctl: {what}: none: nothing to cancel", file=sys.stderr)
        return 0
    if (more := jobs[-1].get(MORE)) is not None:
        print(
            f"poolctl: {more} more not shown; run it again for them once these are cancelled", file=sys.stderr
        )
    if not args.yes:
        if not sys.stdin.isatty():
            raise UsageError(
                f"{what}: {len(jobs)} job(s); with no terminal to ask on, add --yes to cancel them "
                "(poolctl ls with the same options lists them)"
            )
        render.jobs(jobs, as_json=False)
        answer = input(f"cancel these {len(jobs)} job(s)? [y/N] ").strip().lower()
        if answer not in ("y", "yes"):
            print("poolctl: nothing cancelled", file=sys.stderr)
            return 0
    states = cancel_ids(CancelJobs([j["id"] for j in jobs])).states
    for job_id, state in states.items():
        print(render.json_text({"id": job_id, "state": state}) if args.json else f"{job_id}\t{state}")
    done = sum(1 for state in states.values() if state in CANCELLED)
    not_yours = sum(1 for state in states.values() if state == "not_yours")
    print(f"poolctl: cancelled {done} of {len(jobs)} job(s): {what}", file=sys.stderr)
    if not_yours:
        print(
            f"poolctl: {not_yours} of them are another user's: only their owner or a pool admin may "
            "cancel them; they were left as they were",
            file=sys.stderr,
        )
        return EXIT_NOT_YOURS
    return 0
