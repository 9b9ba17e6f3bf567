"""What an enqueue command line asks the server: the spec its options describe (`spec_of`), one
request or a batch (--array, --sweep, --from-file), and where to look for the job's project. Checked
here as far as the command line alone can say, before any connection or upload: the server
validates the whole spec again."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from daemon.ctl.parsing import UsageError
from protocol import Enqueue, EnqueueBatch


def project_start(args: argparse.Namespace) -> Path | None:
    """Where to look for the job's project (daemon/ctl/project.py), or None for none: `--workdir
    DIR`, else here (a cheap look for a project first: outside one, nothing is asked of git), unless
    the job runs elsewhere (--workdir none, --cwd, --git, --from-file)."""
    from daemon.ctl.project_root import maybe_within, real

    if args.workdir == "none":
        if args.snapshot:
            raise UsageError("--snapshot runs the job in its project; --workdir none in a scratch directory")
        return None
    if args.from_file:
        if args.workdir or args.snapshot:
            raise UsageError("--workdir and --snapshot go with one command, not --from-file")
        return None
    if args.workdir:
        if not os.path.isdir(args.workdir):
            raise UsageError(f"--workdir {args.workdir}: no such directory")
        return real(Path(args.workdir))
    here = real(Path.cwd())
    if args.cwd or args.git is not None:
        return here if args.snapshot else None  # --snapshot with them: refused by spec_of
    if args.snapshot or maybe_within(here, real(Path.home())):
        return here
    return None


def enqueue_request(args: argparse.Namespace) -> Enqueue | EnqueueBatch:
    args.project_dir = project_start(args)
    if args.array or args.sweep:
        if args.from_file or args.input or args.follow or args.key:
            raise UsageError(
                "--array and --sweep go with one command, not --from-file, --input, --follow or --key"
            )
        from daemon.ctl.arrays import ArrayError, array_specs, parse_array, parse_sweep

        try:
            indices, limit = parse_array(args.array) if args.array else (None, 0)
            args.array_id, specs = array_specs(spec_of(args), indices, parse_sweep(args.sweep), limit)
        except ArrayError as exc:
            raise UsageError(str(exc)) from None
        return EnqueueBatch(specs)
    if args.from_file:
        if args.input:
            raise UsageError("--input goes with one job, not --from-file")
        if args.follow:
            raise UsageError("--follow goes with one job, not --from-file")
        from daemon.ctl.jobs_file import read_jobs

        return EnqueueBatch(read_jobs(args.from_file))
    return Enqueue(spec_of(args), args.key)


def spec_of(args: argparse.Namespace) -> dict[str, Any]:
    """The spec the command line describes, less what must be read or uploaded (git, inputs, the
    project); refused here if its parts exclude each other (the server validates the whole spec;
    this spares an upload that would be refused)."""
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise UsageError("nothing to run: give the command after --, e.g. poolctl enqueue -- python train.py")
    env = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--env {item!r}: expected NAME=VALUE")
        env[name] = value
    spec: dict[str, Any] = {
        "argv": argv,
        "queue": args.queue,
        "name": args.name,
        "env": env,
        "gpus": args.gpus,
        "wait_for_worker": args.wait_for_worker,
        "timeout": args.timeout,
        "retries": args.retries,
        "priority": args.priority,
        "checkpoint_every": args.checkpoint_every,
        "stop_signal": args.stop_signal,
        "stop_grace": args.stop_grace,
        "max_attempts": args.max_attempts,
        "cwd": str(Path(args.cwd).resolve()) if args.cwd else None,
    }
    if args.gpu_mem:  # sent only when asked for: a server that does not know it refuses the field
        spec["gpu_mem"] = args.gpu_mem
    if args.cpus:  # the same
        spec["cpus"] = args.cpus
    if args.mem:  # the same
        spec["mem"] = args.mem
    if args.notify:  # the same; checked here too, before any upload
        spec["notify"] = notify_url(args.notify)
    if args.no_env:  # the same
        spec["env_from_lock"] = False
    if args.after:
        spec["after"] = args.after
    given = {
        "cwd": args.cwd,
        "git": args.git is not None,
        "inputs": args.input,
        "project": getattr(args, "project_dir", None) is not None,  # (enqueue_request sets it)
    }
    from daemon.exclusive import check_combination, check_gpu_request  # only enqueue asks

    check_combination({name for name, value in given.items() if value})
    check_gpu_request(args.gpus, args.gpu_mem)
    if args.ref and args.git is None:
        raise UsageError("--ref goes with --git")
    return spec


def notify_url(url: str) -> str:
    from daemon.webhook import check_url  # only enqueue asks

    try:
        return check_url(url)
    except ValueError as exc:
        raise UsageError(f"--notify {url!r}: {exc}") from None
