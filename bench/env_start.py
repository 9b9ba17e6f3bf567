"""How fast a job starts in the environment its lock describes (issue 45 item 2, worker/envs.py).

- warm: submit -> the job's first line (`python -c print`) in a project whose environment this
  worker has built, next to the same job with --no-env (env_from_lock: false), alternated;
- cold, hermetic: a fresh worker (empty environment cache, empty uv cache) builds a local
  wheelhouse's lock, next to `uv sync --frozen` alone from an empty uv cache;
- cold, PyPI (unless --quick, which needs no network): the same for numpy and pandas;
- the peer, with --ray-python (a Python with ray[default]): Ray Jobs running the same locks
  with `working_dir` and `uv run --frozen`, cold and warm (bench/peer_apps/ray_env.py).

Medians of --runs (>= 5). A real in-process Worker as this process's user, on a redis-server of
its own. `python -m bench.env_start [--quick] [--runs N] [--ray-python PYTHON]`; `make bench` runs
it (with --quick: no network).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from bench.common import machine, median, save
from daemon.job import JobSpec
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.worker.dispatcher import Worker
from daemon.worker.env_build import EnvSettings, find_uv
from tests.support.wheels import locked_project, make_wheel

ECHO = ("sh", "-c", "echo READY")  # the start alone
PRINT = ("python", "-c", "print('READY')")  # and a Python's (the environment's, or the worker's PATH's)


@contextlib.asynccontextmanager
async def worker(queue: JobQueue, data: Path, settings: EnvSettings) -> AsyncIterator[Worker]:
    w = Worker(
        queue,
        data_dir=data,
        slots=2,
        gpus=[],
        heartbeat_seconds=1.0,
        drain_timeout=0.0,
        env_settings=settings,
    )
    await w.start()
    try:
        yield w
    finally:
        await w.stop()


async def first_line(
    queue: JobQueue, cwd: Path, env_from_lock: bool = True, argv: tuple[str, ...] = PRINT
) -> float:
    """Seconds from submit to the job's first line of its own (the environment's note comes first)."""
    started = time.perf_counter()
    job_id, _ = await queue.enqueue(JobSpec(argv=argv, cwd=str(cwd), env_from_lock=env_from_lock))
    after, seen = "0-0", b""
    while b"READY" not in seen:
        chunks = await queue.read_log(job_id, after, block=5.0)
        if not chunks and (info := await queue.get(job_id)).state.name in {"SUCCEEDED", "FAILED"}:
            raise RuntimeError(f"job {job_id} ended without its line: {info.detail} {seen[-2000:]!r}")
        if not chunks:
            continue
        after, seen = chunks[-1][0], seen + b"".join(data for _, data in chunks)
    took = time.perf_counter() - started
    while (await queue.get(job_id)).state.name not in {"SUCCEEDED", "FAILED"}:  # noqa: ASYNC110 - a bench polls
        await asyncio.sleep(0.01)
    return took


def uv_sync_alone(
    project: Path, scratch: Path, settings: EnvSettings, compile_bytecode: bool, imports: str
) -> tuple[float, float]:
    """`uv sync --frozen` into a new environment from an empty uv cache (with `compile_bytecode`,
    as the worker builds: its jobs cannot write .pyc files into the environment), then the first
    `import` of `imports` in it, as a laptop's first run: (seconds to sync, seconds to import)."""
    uv = find_uv()
    assert uv is not None
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(scratch),
        "UV_CACHE_DIR": str(scratch / "uv-cache"),
        "UV_PROJECT_ENVIRONMENT": str(scratch / "venv"),
        "UV_NO_CONFIG": "1",
        "UV_PYTHON_DOWNLOADS": "never",
        "UV_NO_PROGRESS": "1",
        "UV_COMPILE_BYTECODE": "1" if compile_bytecode else "0",
        **{k: v for k, v in os.environ.items() if k in {"SSL_CERT_FILE", "SSL_CERT_DIR"}},  # a proxy's CA
        **settings.uv_env(),
    }
    started = time.perf_counter()
    sync = [uv, "sync", "--frozen", "--no-install-project", "--quiet", "--project", str(project)]
    subprocess.run(sync, env=env, check=True)
    synced = time.perf_counter()
    subprocess.run([scratch / "venv" / "bin" / "python", "-c", f"import {imports}"], check=True)
    return synced - started, time.perf_counter() - synced


async def cold(
    queue: JobQueue, project: Path, base: Path, settings: EnvSettings, runs: int, *, imports: str
) -> dict[str, Any]:
    """Each run from empty caches: our first line (a bare print, and after importing `imports`)
    from a fresh worker (and the import once more, warm, its bytecode made), and uv alone
    (without and with bytecode, then the first import), alternated."""
    times: dict[str, list[float]] = {}
    importing = ("python", "-c", f"import {imports}; print('READY')")
    for n in range(runs):
        for name, argv in (("ours_print", PRINT), ("ours_import", importing)):
            async with worker(queue, base / f"cold-{project.name}-{name}-{n}", settings) as w:
                times.setdefault(name, []).append(await first_line(queue, project, argv=argv))
                if argv is importing:  # and once its bytecode is made: every later job's start
                    await w.envs.settled()
                    times.setdefault("ours_import_warm", []).append(
                        await first_line(queue, project, argv=argv)
                    )
        for compiled in (False, True):
            scratch = base / f"alone-{project.name}-{n}-{compiled}"
            sync, first = await asyncio.to_thread(
                uv_sync_alone, project, scratch, settings, compiled, imports
            )
            times.setdefault(f"uv_sync{'_compiled' if compiled else ''}", []).append(sync)
            times.setdefault(f"uv_sync{'_compiled' if compiled else ''}_then_import", []).append(sync + first)
    row: dict[str, Any] = {f"{name}_s": median(values) for name, values in times.items()}
    row["ratio_print_to_uv_sync"] = row["ours_print_s"] / row["uv_sync_s"]
    row["ratio_print_to_uv_sync_compiled"] = row["ours_print_s"] / row["uv_sync_compiled_s"]
    row["ratio_import_to_uv_sync_then_import"] = row["ours_import_s"] / row["uv_sync_then_import_s"]
    row["runs"] = runs
    return row


def ray_peer(ray_python: str, project: Path, imports: str, runs: int) -> dict[str, Any]:
    """Ray Jobs' submit -> first line for the same lock, cold and warm (its own process)."""
    helper = Path(__file__).parent / "peer_apps" / "ray_env.py"
    uv = find_uv()
    assert uv is not None
    out = subprocess.run(
        [ray_python, str(helper), str(project), uv, imports, str(runs)],
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    times = json.loads(out.stdout.strip().splitlines()[-1])
    return {"ray_cold_s": median(times["cold"]), "ray_warm_s": median(times["warm"]), "runs": runs}


async def measure(quick: bool, runs: int, ray_python: str | None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-env-") as tmp:
        base = Path(tmp)
        redis = EmbeddedRedis(base / "redis")
        redis.start()
        client = redis.client()
        try:
            queue = JobQueue(client)
            wheels = base / "wheels"
            for name in ("tinypkg", "otherpkg"):
                make_wheel(wheels, name)
            hermetic = locked_project(base / "hermetic", wheels, "tinypkg==1.0", "otherpkg==1.0")
            local = EnvSettings(find_links=(str(wheels),), index_url="http://127.0.0.1:9/simple")

            async with worker(queue, base / "warm", local):
                await first_line(queue, hermetic)  # built once
                for name, argv in (("warm_echo", ECHO), ("warm_python", PRINT)):
                    with_env, without = [], []
                    for _ in range(runs):
                        with_env.append(await first_line(queue, hermetic, argv=argv))
                        without.append(await first_line(queue, hermetic, env_from_lock=False, argv=argv))
                    results[name] = {
                        "with_env_s": median(with_env),
                        "no_env_s": median(without),
                        "difference_ms": (median(with_env) - median(without)) * 1000,
                        "runs": runs,
                    }
            if ray_python:
                results["ray_hermetic"] = await asyncio.to_thread(
                    ray_peer, ray_python, hermetic, "tinypkg, otherpkg", runs
                )
            results["cold_hermetic"] = await cold(
                queue, hermetic, base, local, runs, imports="tinypkg, otherpkg"
            )
            if not quick:
                pypi = base / "pypi"
                pypi.mkdir()
                (pypi / "pyproject.toml").write_text(
                    '[project]\nname = "pypi"\nversion = "0.1"\nrequires-python = ">=3.11"\n'
                    'dependencies = ["numpy", "pandas"]\n'
                )
                uv = find_uv()
                assert uv is not None
                lock = [uv, "lock", "--quiet", "--no-config"]
                await asyncio.to_thread(subprocess.run, lock, cwd=pypi, check=True)
                if ray_python:
                    results["ray_pypi"] = await asyncio.to_thread(
                        ray_peer, ray_python, pypi, "numpy, pandas", runs
                    )
                results["cold_pypi"] = await cold(
                    queue, pypi, base, EnvSettings(), runs, imports="numpy, pandas"
                )
        finally:
            await client.aclose()
            redis.stop()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="hermetic only: no network")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--ray-python", metavar="PYTHON", help="a Python with ray[default]: Ray Jobs beside")
    args = parser.parse_args(argv)
    results = asyncio.run(measure(args.quick, max(args.runs, 5), args.ray_python))
    for name, row in results.items():
        print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    save("env_start", {"machine": machine(), **results})


if __name__ == "__main__":
    main()
