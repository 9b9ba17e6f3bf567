"""`poolctl enqueue`'s command line: its options, and the sizes --gpu-mem takes.

Apart from daemon/ctl/cli.py, which builds the other commands' parsers and runs them, because
enqueue has more options than all the others together. Parsing only: what the options mean is
cli.py's `_spec` and the server's.
"""

from __future__ import annotations

import argparse
import re
from decimal import Decimal
from typing import Any

from daemon.ctl.parsing import seconds, whole

# daemon/spec_checks.py's limits, said again so that ctl need not import the job model (a test checks)
GPU_MEM_MAX = 2**50
GPUS_MAX, ATTEMPTS_MAX, PRIORITY_MAX, STOP_GRACE_MAX = 1024, 100, 100, 3600.0
CPUS_MAX, MEM_MIN = 4096, 2**20
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_SIZE = re.compile(r"(?P<number>\d+(?:\.\d+)?|\.\d+)\s*(?:(?P<unit>[kmgt])(?:i?b)?|b)?", re.IGNORECASE)


def gpu_mem_size(text: str) -> int:
    """Bytes of a size as a person writes it: 20G, 20GiB, 20GB, 512M, 1.5T, 4096 (bytes); units
    are powers of 1024, as GPU memory is sold and as nvidia-smi shows it. An argparse type: a bad
    size is a one-line usage error, exit status 2."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: expected a number and a unit, e.g. 20G, 512M or 1.5T"
        )
    size = int(Decimal(m["number"]) * _UNITS[(m["unit"] or "").lower()])
    if not 0 < size <= GPU_MEM_MAX:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size from 1 byte to 1024T")
    return size


def job_mem_size(text: str) -> int:
    """A job's --mem: a size as `gpu_mem_size` reads it, of a MiB at least (a bare 4096, a
    Slurm user's MiB, would be 4096 bytes: a job killed by its own limit at once)."""
    size = gpu_mem_size(text)
    if size < MEM_MIN:
        raise argparse.ArgumentTypeError(
            f"{text!r} is {size} bytes, less than a MiB: give a unit, e.g. {text.strip()}M or {text.strip()}G"
        )
    return size


def add_enqueue(sub: Any) -> None:  # argparse's _SubParsersAction, which it does not export
    e = sub.add_parser("enqueue", help="queue a job: poolctl enqueue [options] -- CMD [ARG...]")
    e.add_argument("--queue", "-q", default="default")
    e.add_argument("--gpus", type=whole(0, GPUS_MAX), default=0, help="GPUs the job needs")
    e.add_argument(
        "--gpu-mem",
        type=gpu_mem_size,
        default=0,
        metavar="SIZE",
        help="instead of --gpus: the memory the job needs on one GPU it may share with other jobs, "
        "e.g. 20G (K, M, G, T: powers of 1024)",
    )
    e.add_argument(
        "--cpus",
        type=whole(1, CPUS_MAX),
        default=0,
        metavar="N",
        help="CPUs the job needs on its worker: it starts where that many are free, and its "
        "processes get that much CPU time at most (default: the queue's, else no limit)",
    )
    e.add_argument(
        "--mem",
        type=job_mem_size,
        default=0,
        metavar="SIZE",
        help="memory the job needs on its worker, e.g. 16G: it starts where that much is free, and "
        "fails, saying so, if it uses more (default: the queue's, else no limit)",
    )
    e.add_argument(
        "--wait-for-worker",
        action="store_true",
        help="queue a --gpus (or --gpu-mem, --cpus, --mem) job even if no worker in the pool has that "
        "many GPUs (or a GPU that large, that many CPUs, that much memory) yet, or a job for a "
        "--queue no worker serves yet",
    )
    e.add_argument("--name", default="")
    e.add_argument(
        "--env", action="append", default=[], metavar="K=V", help="environment variable (repeatable)"
    )
    e.add_argument(
        "--cwd",
        help="a directory on the worker to run in, as it is there (default: a copy of the project "
        "poolctl runs in, see --workdir)",
    )
    e.add_argument(
        "--workdir",
        metavar="DIR|none",
        help="the project to run in a copy of (default: the one poolctl runs in: its git working "
        "tree, or the nearest directory up with pyproject.toml, requirements.txt or uv.lock; its "
        "files less .gitignore's and .poolignore's, sent as content-addressed packs, unchanged ones "
        "never twice); none: an empty scratch directory",
    )
    e.add_argument(
        "--git",
        nargs="?",
        const="",
        metavar="REPO",
        help="run in a checkout of REPO (default: this checkout's origin, at its exact HEAD commit)",
    )
    e.add_argument("--ref", help="with --git: the branch, tag or commit to run (default: HEAD)")
    e.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME_OR_PATH[:DEST]",
        help="a dataset (a `put` name, or a local file or directory, uploaded first) placed at DEST "
        "in the job's directory (repeatable)",
    )
    e.add_argument(
        "--snapshot",
        action="store_true",
        help="the default now: the same as leaving it out, except that it refuses to run outside "
        "a project (kept for the scripts that give it)",
    )
    e.add_argument("--timeout", type=seconds(), metavar="SECONDS", help="stop the job after this long")
    e.add_argument(
        "--stop-signal",
        "--signal",
        default="TERM",
        metavar="SIG",
        help="the signal that asks the job to stop (a cancel, a timeout, a requeue, a drain): "
        "TERM (default), INT, HUP, USR1, USR2 or QUIT; SIGKILL follows after the grace",
    )
    e.add_argument(
        "--stop-grace",
        "--checkpoint-grace",
        type=seconds(most=STOP_GRACE_MAX),
        metavar="SECONDS",
        help="how long the job has after that signal, to save its state, before SIGKILL "
        "(default: the worker's kill_grace; at most 3600)",
    )
    e.add_argument(
        "--checkpoint-every",
        type=seconds(),
        metavar="SECONDS",
        help="save $GPUPOOL_CHECKPOINT_DIR this often while the job runs (it is saved at every "
        "attempt's end anyway; the next attempt starts with the newest save)",
    )
    e.add_argument(
        "--retries", type=whole(0, ATTEMPTS_MAX), default=0, help="extra attempts after a non-zero exit"
    )
    e.add_argument(
        "--array",
        metavar="0-99[%N]",
        help="one job per index, each finding it in $GPUPOOL_ARRAY_INDEX; %%N: at most N of them run at "
        "once; prints the array's id, which cancel, wait and show take for all its jobs",
    )
    e.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="NAME=V1,V2",
        help="one job per combination of the values (repeatable: the cartesian product), each with "
        "NAME=value in its environment and {NAME} in the command replaced by it; an array",
    )
    e.add_argument(
        "--after",
        action="append",
        default=[],
        metavar="JOB[:ok|:fail|:any]",
        help="start only once JOB has succeeded (:ok, the default), failed (:fail) or ended (:any); "
        "repeatable; if it ends otherwise, this job is cancelled, saying why",
    )
    e.add_argument(
        "--priority",
        type=whole(0, PRIORITY_MAX),
        default=0,
        metavar="N",
        help="start before the queue's jobs of lower priority (0-100, up to your ceiling; default 0)",
    )
    e.add_argument(
        "--max-attempts",
        type=whole(1, ATTEMPTS_MAX),
        default=3,
        help="attempts lost to dead workers before giving up",
    )
    e.add_argument(
        "--no-env",
        action="store_true",
        help="run with the worker's own Python, not in the environment the worker builds from the "
        "lock in the job's directory (uv.lock, pylock.toml or a hash-pinned requirements.txt)",
    )
    e.add_argument(
        "--notify",
        metavar="URL",
        help="when the job ends, the server POSTs its final record (JSON, signed with a key made from "
        "your token) to this http(s) URL: a public address, unless the pool's notify_allow lists it",
    )
    e.add_argument(
        "--key",
        metavar="IDEMPOTENCY_KEY",
        help="same key, same job: safe to retry (a key is yours in its queue; sent again with "
        "another command or options, it is refused)",
    )
    e.add_argument("--from-file", metavar="JOBS.jsonl", help="queue one job per JSON line (a job spec each)")
    e.add_argument("--json", action="store_true")
    e.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="then follow the job's output and exit with its exit code (Ctrl-C stops following; "
        "the job runs on)",
    )
    e.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]")
