"""poolctl's start-up: how long one command takes, from exec to exit, against an idle local pool.

A command a script runs in a loop (`poolctl show`, `poolctl enqueue`) is mostly the interpreter
starting and importing; the request itself is a millisecond. Measured side by side, `--runs`
times each after one unmeasured run (median, and its ratio to the bare interpreter), round-robin
so that the machine's drift spreads over all of them, with bytecode cached as an install has it:

- `python -c pass`: the same interpreter and site (the floor of any Python command);
- bare request: the least a Python client of this protocol does, in a fresh interpreter: import
  `daemon.ctl.one_shot`, connect, authenticate, one ShowJob;
- `poolctl enqueue -- true`, `poolctl show JOB`, `poolctl ls`: the console script, as users run it
  after `make run` (the pool is pools.toml's `local`, the token in its file);
- `sbatch --wrap true` and `tsp true`, where installed (the bench installs nothing).

The pool: a real PoolServer in this process (embedded Redis, no workers), on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.common import bench_server, machine, save
from daemon import pools, tokens

POOLCTL = str(Path(sys.executable).with_name("poolctl"))
BARE_REQUEST = (
    "import sys; from daemon.ctl import one_shot; from protocol import JobDetail, ShowJob; "
    "one_shot.call(sys.argv[1], sys.argv[2], sys.argv[3], ShowJob(sys.argv[4]), JobDetail)"
)


async def timed(argv: list[str], env: dict[str, str]) -> float:
    """Seconds from exec to exit; the command must succeed."""
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *argv, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({proc.returncode}): {err.decode()[-500:]}")
    return elapsed


async def measure(runs: int, config_dir: Path) -> dict[str, Any]:
    async with bench_server() as server:
        assert server.listener is not None
        address, user, token = server.listener.address, tokens.local_user(), tokens.client_token()
        # As a user's install runs: with its modules' bytecode cached (pip compiles on install;
        # an editable one writes it on first import, unless PYTHONDONTWRITEBYTECODE says not to).
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        assert token is not None
        # As `make run` leaves a user: the pool is pools.toml's "local", the token in a file.
        for name in ("GPUPOOL_SERVER", "GPUPOOL_POOL", "GPUPOOL_TOKEN"):
            env.pop(name, None)
        env["XDG_CONFIG_HOME"] = str(config_dir)
        token_file = tokens.client_dir(env) / "token"
        tokens.write_private(token_file, token + "\n")
        pools.register_local(address, token_file, env=env)
        out = await asyncio.create_subprocess_exec(
            POOLCTL, "enqueue", "--", "true", env=env, stdout=asyncio.subprocess.PIPE
        )
        job = (await out.communicate())[0].decode().strip()
        commands: dict[str, list[str]] = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "bare request (one_shot, ShowJob)": [
                sys.executable,
                "-c",
                BARE_REQUEST,
                address,
                user,
                token,
                job,
            ],
            "poolctl enqueue -- true": [POOLCTL, "enqueue", "--", "true"],
            "poolctl show JOB": [POOLCTL, "show", job],
            "poolctl ls": [POOLCTL, "ls"],
        }
        if shutil.which("sbatch"):
            commands["sbatch --wrap true"] = ["sbatch", "--wrap", "true"]
        if shutil.which("tsp"):
            commands["tsp true"] = ["tsp", "true"]
        for argv in commands.values():  # once each, unmeasured: the bytecode cache is written
            await timed(argv, env)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(runs):  # round-robin: drift reaches every command alike
            for name, argv in commands.items():
                times[name].append(await timed(argv, env))
    medians = {name: statistics.median(ts) * 1000 for name, ts in times.items()}
    base = medians["python -c pass"]
    return {
        "machine": machine(),
        "runs": runs,
        "ms": {name: {"median": m, "ratio_to_python": m / base} for name, m in medians.items()},
        "not_installed": [t for t in ("sbatch", "tsp") if not shutil.which(t)],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="5 runs")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as config_dir:
        result = asyncio.run(measure(5 if args.quick else args.runs, Path(config_dir)))
    t = Table(title=f"command start to exit, median of {result['runs']} (ms)")
    for col in ("command", "ms", "/ python -c pass"):
        t.add_column(col, justify="left" if col == "command" else "right")
    for name, m in result["ms"].items():
        t.add_row(name, f"{m['median']:.1f}", f"{m['ratio_to_python']:.1f}x")
    Console().print(t)
    if result["not_installed"]:
        print(f"not installed, not measured: {', '.join(result['not_installed'])}")
    print(f"wrote {save('cli_startup', result)}")


if __name__ == "__main__":
    main()
