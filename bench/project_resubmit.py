"""A project's submit and resubmit (issue 45 item 1): seconds and bytes sent by `poolctl enqueue`.

A git project of `--files` files and `--mb` MB in all (each file the same size, random bytes, in
100 directories), committed, and a real `poolctl enqueue -- true` run in it, as a user runs it,
against a real PoolServer in this process (embedded Redis, its local store, no workers). Each
round makes a new project (so its first submit finds nothing stored) and a new poolctl cache, then
times, exec to exit:

- first submit: every pack sent;
- unchanged resubmit: the packs' sha256s from poolctl's hash cache, nothing sent;
- unchanged, hash cache off (GPUPOOL_PACK_CACHE=off): every file read and hashed again, nothing sent;
- one file changed (rewritten, same size; another file each round): its pack sent.

Bytes sent: what the store gained (its objects' bytes after, less before). Medians of `--rounds`
(≥ 5). Beside them: `poolctl enqueue --workdir none -- true` (no project) and `python -c pass`.
`--tiny` is the size the test suite runs (tests/daemon/ctl/test_project.py) to keep it working.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.common import bench_server, machine, save
from daemon import tokens

ROOT = Path(__file__).resolve().parent.parent  # this checkout: its poolctl, wherever it runs
CASES = ("first submit", "unchanged resubmit", "unchanged, hash cache off", "one file changed")


def make_project(root: Path, files: int, total: int) -> list[Path]:
    """A committed git project of `files` files of random bytes, `total` bytes in all."""
    root.mkdir(parents=True)
    size = max(1, total // files)
    paths = []
    for i in range(files):
        path = root / f"pkg{i % 100:02d}" / f"module_{i:05d}.dat"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(size))
        paths.append(path)
    (root / "pyproject.toml").write_text("[tool.bench]\n")  # a marker; no [project]: no lock
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b"}
    env |= {"GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@b"}
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "project"]):
        quiet = ["-c", "gc.auto=0", "-c", "maintenance.auto=false"]  # nothing left writing in .git
        subprocess.run(["git", *quiet, *argv], cwd=root, env=env, check=True, capture_output=True)
    return paths


def stored_bytes(store_root: Path) -> int:
    return sum(p.stat().st_size for p in store_root.rglob("*") if p.is_file())


async def poolctl(env: dict[str, str], cwd: Path, *args: str) -> float:
    """Seconds from exec to exit of `poolctl ARGS` in `cwd`; it must succeed."""
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "daemon.ctl.cli", *args, cwd=cwd, env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await proc.communicate()
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"poolctl {' '.join(args)} failed ({proc.returncode}): {err.decode()[-500:]}")
    return elapsed


async def measure(rounds: int, files: int, total: int, work: Path) -> dict[str, Any]:
    seconds: dict[str, list[float]] = {c: [] for c in (*CASES, "no project (--workdir none)")}
    sent: dict[str, list[int]] = {c: [] for c in CASES}
    async with bench_server() as server:
        assert server.listener is not None
        store_root = Path(server.config.data_dir) / "store"
        token = tokens.client_token()
        assert token is not None
        base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        base |= {"GPUPOOL_SERVER": server.listener.address, "GPUPOOL_USER": tokens.local_user()}
        base |= {"GPUPOOL_TOKEN": token, "HOME": str(work), "PYTHONPATH": str(ROOT)}
        for n in range(rounds):
            project = work / f"round{n}" / "project"
            paths = await asyncio.to_thread(make_project, project, files, total)
            env = {**base, "XDG_CACHE_HOME": str(work / f"round{n}" / "cache")}
            steps: list[tuple[str, dict[str, str]]] = [
                ("first submit", env),
                ("unchanged resubmit", env),
                ("unchanged, hash cache off", {**env, "GPUPOOL_PACK_CACHE": "off"}),
            ]
            if n == 0:  # bytecode written, the store's directories made: not what is measured
                await poolctl(env, work, "enqueue", "--", "true")
            for case, case_env in steps:
                before = await asyncio.to_thread(stored_bytes, store_root)
                seconds[case].append(await poolctl(case_env, project, "enqueue", "--", "true"))
                sent[case].append(await asyncio.to_thread(stored_bytes, store_root) - before)
            changed = random.Random(n).choice(paths)  # a file of another pack each round
            changed.write_bytes(os.urandom(changed.stat().st_size))
            before = await asyncio.to_thread(stored_bytes, store_root)
            seconds["one file changed"].append(await poolctl(env, project, "enqueue", "--", "true"))
            sent["one file changed"].append(await asyncio.to_thread(stored_bytes, store_root) - before)
            seconds["no project (--workdir none)"].append(
                await poolctl(env, project, "enqueue", "--workdir", "none", "--", "true")
            )
    return {
        "machine": machine(),
        "rounds": rounds,
        "files": files,
        "bytes": total,
        "seconds": {c: statistics.median(v) for c, v in seconds.items()},
        "bytes_sent": {c: statistics.median(v) for c, v in sent.items()},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--files", type=int, default=10_000)
    p.add_argument("--mb", type=float, default=200.0)
    p.add_argument("--tiny", action="store_true", help="200 files, 2 MB, 1 round (the test suite's)")
    p.add_argument("--quick", action="store_true", help="2 000 files, 40 MB")
    args = p.parse_args(argv)
    if args.tiny:
        args.files, args.mb, args.rounds = 200, 2.0, 1
    elif args.quick:
        args.files, args.mb = 2_000, 40.0
    total = int(args.mb * 1e6)
    with tempfile.TemporaryDirectory(prefix="bench-project-") as work:
        result = asyncio.run(measure(args.rounds, args.files, total, Path(work)))
    title = f"poolctl enqueue in a {args.files}-file, {args.mb:g} MB git project, median of {args.rounds}"
    t = Table(title=title)
    for col in ("submit", "seconds", "bytes sent", "/ project"):
        t.add_column(col, justify="left" if col == "submit" else "right")
    for case, secs in result["seconds"].items():
        nbytes = result["bytes_sent"].get(case)
        share = "-" if nbytes is None else f"{nbytes / total:.1%}"
        t.add_row(case, f"{secs:.3f}", "-" if nbytes is None else f"{nbytes:,.0f}", share)
    Console().print(t)
    if not args.tiny:
        print(f"wrote {save('project_resubmit', result)}")


if __name__ == "__main__":
    main()
