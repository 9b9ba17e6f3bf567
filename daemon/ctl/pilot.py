"""`poolctl pilot slurm|pbs`: the pool's workers as batch jobs on a cluster run by Slurm or PBS.

A team with no GPU servers of its own but an account on a batch cluster runs its pool's server,
Redis and S3 somewhere the cluster's nodes can reach, and lends the pool nodes for a while: each
pilot is one batch job that runs `poold --worker`, joins the pool, serves its queues, and leaves
by itself (daemon/worker/lifetime.py): after `--idle-exit` seconds with no job, and in any case
drained and gone before its walltime, since `--max-lifetime` is the walltime less a margin. Its
jobs are chosen so that their `--timeout` ends before it must leave; what still runs at its end is
handed back, as on SIGTERM, and runs again on another worker.

A pilot is not root: it runs every job as the cluster user who submitted it, and any of those
jobs can read what that user can, the pilot's config included. So a pilot is an agent of the pool
server (`worker_via_server`, daemon/worker/agent.py): its config names the server and a token
file, the pool user's own token, kept readable by that user only (cluster home directories are
shared with every node and often readable by the group); a config others may read, or one
holding the pool's Redis password or S3 keys, is refused. The server runs a worker for it that
makes every write, and runs there only the jobs of the pool user it acts as (`--serve-user`,
else the one poolctl acts as), passing the others' over: a job on a pilot can act only as its
own user already may. Its node-local tree (scratch, the dataset cache) is
made anew for each pilot by mktemp, mode 700, under the node's TMPDIR. The script
drops the submitting shell's GPUPOOL_* variables, so that the file alone says what the worker
does, and it execs poold, so that the scheduler's signals reach the worker itself (a shell in
between would die at a scancel and take the draining worker with it).

The scripts are built here and submitted one batch job per pilot: to `sbatch` on its standard
input, to `qsub` as a file; `--dry-run` prints a script and the command instead. A PBS script
works with PBS's own qsub (PBS Pro, OpenPBS) and with Slurm's (slurm-wlm-torque: PBS commands over
Slurm, whose qsub hands the script to sbatch): that one reads no script on standard input, turns
only its command line into sbatch options (so the job's name and its one log are said there too),
and leaves the GPUs out of `select=1:ngpus=G` (so an `#SBATCH --gres` line, a comment to PBS, asks
Slurm for them). This module is a command of
poolctl: what only it uses (the daemon's configuration loader, to check the file; subprocess) is
imported when it runs, since poolctl's parser, which every command builds, comes from here.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from daemon.ctl.enqueue_args import GPUS_MAX
from daemon.ctl.parsing import seconds, whole
from daemon.errors import GpupoolError
from protocol import ErrorCode

SUBMIT = {"slurm": "sbatch", "pbs": "qsub"}
DEFAULT_IDLE_EXIT = 600.0  # an idle pilot holds its allocation (and its user's share) for this long
SUBMIT_TIMEOUT = 60.0  # seconds one sbatch/qsub may take (they retry a busy controller themselves)
MAX_PILOTS = 10_000  # --count: Slurm's own default MaxJobCount; more is a typo, not a plan


class PilotError(GpupoolError):
    """The command line asks for a pilot that cannot be; the sentence says why and what to do."""

    code = ErrorCode.INVALID_ARGUMENT  # exit 2, as any usage error


def add_pilot(sub: Any) -> None:
    """The `pilot` subcommand's arguments (`sub`: poolctl's subparsers)."""
    p = sub.add_parser(
        "pilot",
        help="start workers as batch jobs on a Slurm or PBS cluster; they leave before their walltime",
    )
    p.add_argument("scheduler", choices=sorted(SUBMIT), help="the cluster's batch system")
    p.add_argument("--config", required=True, metavar="FILE", help="the workers' pool.toml (mode 600)")
    p.add_argument("--walltime", required=True, metavar="H:MM:SS", help="each pilot's walltime")
    p.add_argument(
        "--count", type=whole(1, MAX_PILOTS), default=1, metavar="N", help="pilots to submit (default 1)"
    )
    p.add_argument(
        "--gpus-per-node", type=whole(0, GPUS_MAX), default=1, metavar="G", help="GPUs each pilot asks for"
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--partition", metavar="P", help="Slurm partition (or PBS queue)")
    where.add_argument("--queue", metavar="Q", help="PBS queue (or Slurm partition)")
    p.add_argument("--account", metavar="A", help="the allocation to charge (sbatch --account, qsub -A)")
    p.add_argument("--name", default="gpupool-pilot", help="the batch jobs' name")
    p.add_argument(
        "--max-lifetime",
        type=seconds(),
        metavar="SECONDS",
        help="when each pilot has left (default: the walltime less a margin for its start and end)",
    )
    p.add_argument(
        "--idle-exit",
        type=seconds(above=False),
        default=DEFAULT_IDLE_EXIT,
        metavar="SECONDS",
        help=f"a pilot with no job for this long leaves (default {DEFAULT_IDLE_EXIT:g}; 0: never)",
    )
    p.add_argument(
        "--serve-user",
        metavar="USER",
        help="the one pool user whose jobs the pilots run (default: the user poolctl acts as)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the script and the submit command")


def run(args: argparse.Namespace) -> int:
    """Build the script; print it (--dry-run) or submit it `--count` times, printing each job id."""
    walltime = parse_walltime(args.walltime)
    config = Path(args.config).expanduser().resolve()
    user = serve_user(args)
    leave = check_config(config, user)
    lifetime = args.max_lifetime if args.max_lifetime is not None else walltime - margin(walltime)
    if not leave < lifetime <= walltime:
        raise PilotError(
            f"a pilot of walltime {args.walltime} would have {lifetime:g} s to live, which must be more "
            f"than the {leave:g} s it takes to leave (drain_timeout + kill_grace in {config}, and a "
            "moment to hand back) and at most "
            "the walltime: give a longer --walltime, or lower drain_timeout there"
        )
    script = batch_script(
        args.scheduler,
        name=args.name,
        walltime=walltime,
        gpus=args.gpus_per_node,
        partition=args.partition or args.queue,
        account=args.account,
        worker=[*poold_command(), "--worker", "--config", str(config), "--serve-user", user],
        max_lifetime=lifetime,
        idle_exit=args.idle_exit,
    )
    command = submit_command(args.scheduler, args.name)
    if args.dry_run:
        print(script, end="")
        times = f", {args.count} times" if args.count > 1 else ""
        given = "FILE, this script saved as FILE" if by_file(command) else "< this script"
        print(f"# submit: {shlex.join(command)} {given}{times}")
        return 0
    import shutil

    if shutil.which(command[0]) is None:
        raise PilotError(
            f"{command[0]} not found: run poolctl pilot {args.scheduler} on a login node of the "
            f"cluster, where {command[0]} is on PATH (--dry-run prints the script)"
        )
    for _ in range(args.count):
        print(submit(command, script), flush=True)
    return 0


def serve_user(args: argparse.Namespace) -> str:
    """The one pool user the pilots serve: `--serve-user`, else the user poolctl acts as on the
    pool it names (GPUPOOL_USER, pools.toml's `user`, the login name). A pilot runs every job as
    the cluster user who submitted it, who can read its config: another pool user's job there
    could read the pool's credentials, so it runs none (daemon/worker/non_root.py)."""
    if args.serve_user is not None:
        if not args.serve_user.strip():
            raise PilotError("--serve-user needs a pool user's name")
        return str(args.serve_user)
    from daemon import tokens
    from daemon.pools import choose

    return tokens.local_user(pool_user=choose(args.server, args.pool).user)


def parse_walltime(text: str) -> float:
    """Seconds of `[D-]H:MM:SS` or `M:SS`, the forms Slurm and PBS read alike (a bare number means
    minutes to one and seconds to the other: refused)."""
    days, _, rest = text.strip().rpartition("-")
    parts = rest.split(":")
    try:
        numbers = [int(p) for p in parts]
        d = int(days) if days else 0
    except ValueError:
        numbers, d = [], 0
    if len(numbers) not in (2, 3) or min([*numbers, d]) < 0 or (days and len(numbers) != 3):
        raise PilotError(f"--walltime {text!r}: expected H:MM:SS (or D-H:MM:SS), e.g. 1:00:00")
    h, m, s = ([0, *numbers] if len(numbers) == 2 else numbers)[:3]
    seconds = ((d * 24 + h) * 60 + m) * 60 + s
    if seconds <= 0:
        raise PilotError(f"--walltime {text!r} is no time at all")
    return float(seconds)


def margin(walltime: float) -> float:
    """What a pilot keeps of its walltime for its start (the scheduler's prologue, before poold
    runs) and its end (closing its connections after the drain): 2%, between 30 s and 5 min."""
    return min(300.0, max(30.0, walltime * 0.02))


def check_config(path: Path, user: str) -> float:
    """Refuse a config file others may read, one that is not an agent's (a pilot holds its user's
    token and no pool credential: docs/DESIGN.md, "Workers that do not run as root"), or one that
    holds the pool's Redis password or S3 keys all the same; the seconds its worker takes to leave
    (drain_timeout + kill_grace, and a moment to hand back). `user`: the pool user it acts as, as
    its command line says (`--serve-user`)."""
    from daemon import config as config_mod
    from daemon.errors import ConfigError
    from daemon.options import OPTIONS  # the secrets among them: none is a pilot's to hold
    from daemon.tokens import refuse_open

    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise PilotError(f"--config {path}: {exc.strerror}") from None
    refuse_open(path, mode, ", a pilot's config, which names a token,")
    try:
        c = config_mod.load(None, env={"GPUPOOL_WORKER_SERVE_USER": user}, config_file=path)
    except ConfigError as exc:
        raise PilotError(str(exc)) from None
    if not c.worker_via_server:
        raise PilotError(
            f"{path}: a pilot is an agent of the pool server, holding its user's token and no Redis or "
            "S3 credential (every job on it runs as you and could read them): set worker_via_server "
            '= "HOST:PORT" of the pool server, reachable from the nodes, and worker_token_file = the '
            "path of your token (mode 600)"
        )
    held = [o.name for o in OPTIONS if o.secret and getattr(c, o.name)]
    if held:
        raise PilotError(
            f"{path} holds {', '.join(held)}: a pilot's jobs run as you and could read them; an agent "
            "needs none (the server makes its writes and signs its transfers): remove them"
        )
    host = c.worker_via_server.rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        print(
            f"poolctl: note: {path} names the server on loopback, which only this node can reach",
            file=sys.stderr,
        )
    return c.leaving_seconds


def poold_command() -> list[str]:
    """How the batch job starts the worker: the poold beside this poolctl (the cluster's nodes see
    the same file system), else this Python running the daemon's module."""
    poold = Path(sys.executable).with_name("poold")
    return [str(poold)] if os.access(poold, os.X_OK) else [sys.executable, "-m", "daemon.main"]


def batch_script(
    scheduler: str,
    *,
    name: str,
    walltime: float,
    gpus: int,
    partition: str | None,
    account: str | None,
    worker: list[str],
    max_lifetime: float,
    idle_exit: float,
) -> str:
    """The batch script of one pilot: the scheduler's directives, then the worker, exec'd."""
    if scheduler == "slurm":
        directives = [
            f"--job-name={name}",
            f"--time={slurm_time(walltime)}",
            "--nodes=1",
            *([f"--gres=gpu:{gpus}"] if gpus else []),
            *([f"--partition={partition}"] if partition else []),
            *([f"--account={account}"] if account else []),
            f"--output={name}-%j.out",
        ]
        prefix, job_id = "#SBATCH ", "SLURM_JOB_ID"
    else:
        directives = [
            f"-N {name}",
            f"-l walltime={pbs_time(walltime)}",
            f"-l select=1:ngpus={gpus}" if gpus else "-l select=1",
            *([f"-q {partition}"] if partition else []),
            *([f"-A {account}"] if account else []),
            "-j oe",
        ]
        prefix, job_id = "#PBS ", "PBS_JOBID"
    argv = [*worker, "--max-lifetime", f"{max_lifetime:g}", "--idle-exit", f"{idle_exit:g}"]
    # Slurm's qsub gives sbatch the script, which reads select's node count but not its GPUs.
    over_slurm = [f"#SBATCH --gres=gpu:{gpus}"] if scheduler == "pbs" and gpus else []
    return "\n".join(
        [
            "#!/bin/bash",
            *(prefix + d for d in directives),
            *over_slurm,
            f"# A gpupool pilot worker, by `poolctl pilot {scheduler}` ({time.strftime('%Y-%m-%d %H:%M')}).",
            "# It joins the pool its config names and leaves by itself, drained, before the walltime",
            f"# ends (--max-lifetime), or after --idle-exit seconds with no job; ${job_id} shows in",
            "# `poolctl workers`. Only the config counts: the submitting shell's GPUPOOL_* are dropped.",
            'for v in $(compgen -v GPUPOOL_); do unset "$v"; done',
            "# node-local scratch and dataset cache: this pilot's own, made anew (mktemp: mode 700,",
            "# a name no one can guess or plant first); the worker refuses one others may open",
            'data_dir=$(mktemp -d "${TMPDIR:-/tmp}/gpupool-pilot.XXXXXXXXXX") || exit 1',
            f'exec {shlex.join(argv)} --data-dir "$data_dir"',
            "",
        ]
    )


def slurm_time(seconds: float) -> str:
    """`D-HH:MM:SS` (or `H:MM:SS` under a day), as sbatch --time reads it."""
    d, rest = divmod(int(seconds), 86400)
    h, rest = divmod(rest, 3600)
    clock = f"{h}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{d}-{h:02d}:{rest // 60:02d}:{rest % 60:02d}" if d else clock


def pbs_time(seconds: float) -> str:
    """`HH:MM:SS` (hours past 24 as they are), as qsub -l walltime reads it."""
    h, rest = divmod(int(seconds), 3600)
    return f"{h:02d}:{rest // 60:02d}:{rest % 60:02d}"


def submit_command(scheduler: str, name: str) -> list[str]:
    """The submit command: sbatch reads the script on its standard input, qsub from a file named
    last (`by_file`). Slurm's qsub reads only its command line, so the PBS job's name and its one
    log (-j oe) are given there as well as in the script (PBS's own qsub takes either)."""
    return ["sbatch", "--parsable"] if scheduler == "slurm" else ["qsub", "-N", name, "-j", "oe"]


def by_file(command: list[str]) -> bool:
    """Whether `command` takes the script as a file (qsub: Slurm's reads none on standard input)."""
    return command[0] == "qsub"


def submit(command: list[str], script: str) -> str:
    """Submit `script` once; its batch job id."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpupool-pilot-") as tmp:
        argv: list[str] = command
        stdin: str | None = script
        if by_file(command):
            path = Path(tmp, "pilot.pbs")  # read at the submit: the scheduler keeps its own copy
            path.write_text(script)
            argv, stdin = [*command, str(path)], None
        try:
            done = subprocess.run(
                argv, input=stdin, capture_output=True, text=True, timeout=SUBMIT_TIMEOUT, check=False
            )
        except subprocess.TimeoutExpired:
            raise GpupoolError(
                f"{command[0]} did not answer in {SUBMIT_TIMEOUT:g} s: is the cluster's controller up?"
            ) from None
        except OSError as exc:
            raise GpupoolError(f"cannot run {command[0]}: {exc.strerror}") from None
    # (Slurm's qsub quotes what sbatch said, on lines of their own)
    said = [line.strip(" '") for line in (done.stderr.strip() or done.stdout.strip()).splitlines()]
    said = [line for line in said if line]
    if done.returncode != 0:
        raise GpupoolError(
            f"{command[0]} refused the pilot: {said[-1] if said else f'exit {done.returncode}'}"
        )
    return done.stdout.strip().split(";")[0]  # sbatch --parsable: ID[;CLUSTER]
