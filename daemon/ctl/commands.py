"""poolctl's command line: every command and its options, as `parser()` builds them (enqueue's in
enqueue_args.py, pilot's in pilot.py). cli.py runs what it parses."""

from __future__ import annotations

import argparse
from typing import Any

from daemon.ctl import render
from daemon.ctl.acct import add_acct
from daemon.ctl.enqueue_args import GPUS_MAX, add_enqueue, gpu_mem_size
from daemon.ctl.parsing import Parser, seconds, whole
from daemon.ctl.pilot import add_pilot

MAX_VIEW_JOBS = 10_000  # the jobs `top` asks for: all there are, as far as the server lists
MAX_VIEWS = 1_000_000  # -n: days of views at the shortest interval; 0 (until Ctrl-C) for more


def add_selection(command: argparse.ArgumentParser, verb: str) -> None:
    """The options that select jobs by their user and name (`ls`, `cancel`), as Slurm's."""
    whose = command.add_mutually_exclusive_group()
    whose.add_argument("--me", action="store_true", help=f"{verb} only your own jobs (squeue --me)")
    whose.add_argument("--user", "-u", metavar="USER", help=f"{verb} only USER's jobs")
    command.add_argument(
        "--name", metavar="PATTERN", help=f"{verb} only the jobs whose NAME (as ls shows it) matches the glob"
    )


def add_ls(sub: Any) -> None:  # argparse's _SubParsersAction, which it does not export
    ls = sub.add_parser("ls", help="list queued and running jobs (like squeue)")
    ls.add_argument("--queue", "-q")
    ls.add_argument("--array", metavar="QUEUE@ID", help="only the jobs of this array (--array, --sweep)")
    ls.add_argument("--state", "-s")
    add_selection(ls, "list")
    ls.add_argument("--all", "-a", action="store_true", help="include finished jobs")
    ls.add_argument("--limit", type=whole(1, MAX_VIEW_JOBS), default=1000, metavar="N")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    ls.add_argument(
        "--format",
        "-o",
        metavar="COLUMNS",
        help=f"the columns to print, in order, e.g. id,state (of: {', '.join(render.JOB_COLUMNS)})",
    )
    ls.add_argument("--no-header", action="store_true", help="the rows alone")
    ls.add_argument(
        "--watch",
        "-w",
        nargs="?",
        type=seconds(),
        const=2.0,
        metavar="SECONDS",
        help="redraw it as it changes, every SECONDS (default 2) until Ctrl-C",
    )
    ls.add_argument(
        "-n", "--views", type=whole(0, MAX_VIEWS), default=0, metavar="N", help="with --watch: stop after N"
    )


def add_pool_views(sub: Any) -> None:
    """The commands that show the pool rather than a job: its workers, and what its jobs used."""
    sub.add_parser("workers", help="the pool's workers").add_argument("--json", action="store_true")
    add_acct(sub)


def add_into_jobs(sub: Any) -> None:
    """The commands that reach into a running job: exec, forward, shell and attach (job_shell.py),
    and jupyter (job_jupyter.py)."""
    inside = sub.add_parser(
        "exec",
        help="run a command inside a running job (its uid, GPUs, environment and directory); "
        "piped stdin goes to it; exits with its code",
    )
    inside.add_argument("job")
    inside.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]")

    forward = sub.add_parser(
        "forward",
        help="forward 127.0.0.1:LOCAL here to PORT inside a running job (its loopback), each "
        "connection through the server, until the job ends; LOCAL 0: any free port, printed",
    )
    forward.add_argument("job")
    forward.add_argument("ports", metavar="[LOCAL:]PORT")

    add_shell(sub)
    add_jupyter(sub)


def add_shell(sub: Any) -> None:
    """`poolctl shell` and `poolctl attach` (job_shell.py)."""
    shell = sub.add_parser(
        "shell",
        help="an interactive job: queued like any other, then this terminal attached to a shell (or "
        "CMD) on a terminal in its allocation; Enter ~ . detaches (poolctl attach JOB returns); "
        "exits with the shell's code",
    )
    size = shell.add_mutually_exclusive_group()
    size.add_argument("--gpus", type=whole(0, GPUS_MAX), default=0, help="GPUs the shell gets")
    size.add_argument(
        "--gpu-mem", type=gpu_mem_size, default=0, metavar="SIZE", help="instead: memory on a shared GPU"
    )
    shell.add_argument("--queue", "-q", default="default")
    shell.add_argument("--time", type=seconds(), metavar="SECONDS", help="end the shell after this long")
    shell.add_argument(
        "--idle",
        type=seconds(),
        metavar="SECONDS",
        help="end it once nothing was typed into it for this long, attached or not (default and "
        "most: the pool's shell_idle_limit)",
    )
    shell.add_argument("--no-env", action="store_true", help="not in the project's locked environment")
    shell.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]")
    attach = sub.add_parser("attach", help="attach this terminal to a running shell again (poolctl shell)")
    attach.add_argument("job")


def add_jupyter(sub: Any) -> None:  # argparse's _SubParsersAction, which it does not export
    """`poolctl jupyter`: enqueue's options that an interactive JupyterLab needs (job_jupyter.py)."""
    lab = sub.add_parser(
        "jupyter",
        help="a JupyterLab in a job of its own, in your project and its environment, forwarded here: "
        "prints its URL; Ctrl-C ends it and cancels the job",
    )
    lab.add_argument("--queue", "-q", default="default")
    size = lab.add_mutually_exclusive_group()
    size.add_argument("--gpus", type=whole(0, GPUS_MAX), default=0, help="GPUs the job needs")
    size.add_argument(
        "--gpu-mem", type=gpu_mem_size, default=0, metavar="SIZE", help="instead: memory on a shared GPU"
    )
    lab.add_argument("--time", type=seconds(), metavar="SECONDS", help="end the job after this long")
    lab.add_argument(
        "--port", type=whole(0, 65535), default=0, metavar="LOCAL", help="the local port (default: any free)"
    )
    lab.add_argument("--open", action="store_true", help="open the URL in a browser too")
    lab.add_argument("--name", default="jupyter", help="the job's name (default: jupyter)")
    lab.add_argument("--workdir", metavar="DIR|none", help="the project to run in, as enqueue's")
    lab.add_argument(
        "--no-env", action="store_true", help="JupyterLab of the worker's own Python, not the lock's"
    )


def parser() -> Parser:
    p = Parser(prog="poolctl", description="Queue and follow jobs on a gpupool pool.")
    p.add_argument(
        "--server",
        metavar="HOST:PORT",
        help="pool server, or several of one pool, comma-separated (default: GPUPOOL_SERVER, or the "
        "local pool)",
    )
    p.add_argument(
        "--pool", metavar="NAME", help="a pool named in ~/.config/gpupool/pools.toml (or GPUPOOL_POOL)"
    )
    p.add_argument(
        "--tls-ca", metavar="FILE", help="CA certificate to verify a TLS server (or GPUPOOL_TLS_CA)"
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add_enqueue(sub)

    add_ls(sub)

    show = sub.add_parser("show", help="everything known about a job")
    show.add_argument("job")
    show.add_argument("--json", action="store_true")

    logs = sub.add_parser("logs", help="a job's output; -f follows it live and exits with the job's code")
    logs.add_argument("job")
    logs.add_argument("-f", "--follow", action="store_true")

    add_into_jobs(sub)

    cancel = sub.add_parser(
        "cancel",
        help="cancel jobs, by id or by --me, --user, --name and --state (your own unless --user "
        "names another's)",
    )
    cancel.add_argument("jobs", nargs="*", metavar="JOB")
    add_selection(cancel, "cancel")
    cancel.add_argument("--state", "-s", help="cancel only the jobs in this state")
    cancel.add_argument(
        "--yes", "-y", action="store_true", help="cancel what the filters select without asking"
    )
    cancel.add_argument("--json", action="store_true", help="one JSON object per job")

    requeue = sub.add_parser(
        "requeue",
        help="stop running jobs (SIGTERM, then SIGKILL after the worker's grace) and put them back "
        "at the front of their queues, to run again with attempt + 1",
    )
    requeue.add_argument("jobs", nargs="+", metavar="JOB")
    requeue.add_argument("--json", action="store_true", help="one JSON object per job")

    wait = sub.add_parser("wait", help="wait for jobs to end; exit 0 only if all succeeded")
    wait.add_argument("jobs", nargs="*", metavar="JOB", help="none: nothing to wait for (exit 0)")
    wait.add_argument(
        "--timeout", type=seconds(above=False), metavar="SECONDS", help="stop waiting after this long"
    )
    wait.add_argument("--json", action="store_true", help="each job's record as it ends, a line each")

    top = sub.add_parser("top", help="a live full-screen view of queues, workers and running jobs")
    top.add_argument("-d", "--delay", type=seconds(), default=2.0, metavar="SECONDS", help="between views")
    top.add_argument(
        "-n", "--views", type=whole(0, MAX_VIEWS), default=0, metavar="N", help="stop after N views"
    )
    top.add_argument("--json", action="store_true", help="one JSON object per view")

    add_pool_views(sub)
    add_pilot(sub)

    put = sub.add_parser("put", help="upload a file or directory as a dataset (skipped if already stored)")
    put.add_argument("path", metavar="PATH")
    put.add_argument("--name", help="a name to use it by: poolctl enqueue --input NAME")
    put.add_argument("--json", action="store_true")

    get = sub.add_parser("get", help="download a finished job's artifacts and log")
    get.add_argument("job")
    get.add_argument("dest", nargs="?", metavar="DEST", help="directory (default: ./JOB)")
    get.add_argument("--json", action="store_true", help="one JSON object per file written")

    sub.add_parser("health", help="exit 0 when the server and its Redis answer (for scripts and probes)")
    completion = sub.add_parser(
        "completion",
        help="shell completion: source <(poolctl completion bash) in ~/.bashrc; "
        "source <(poolctl completion zsh) in ~/.zshrc; "
        "poolctl completion fish > ~/.config/fish/completions/poolctl.fish",
    )
    completion.add_argument("shell", nargs="?", choices=["bash", "zsh", "fish"])
    # what the scripts ask on a TAB (job ids, queue names), one a line; silent when it fails
    completion.add_argument(
        "--words", choices=["jobs", "cancellable", "queues", "pools"], help=argparse.SUPPRESS
    )
    return p
