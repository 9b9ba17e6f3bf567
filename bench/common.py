"""What every benchmark shares: the machine description and the JSON result file, a pool to
measure, and the small parts of an asyncio bench (free ports, bounded waits, a child's stop)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from daemon import config
from daemon.server.service import PoolServer
from tests.support.processes import terminate

RESULTS = Path(__file__).parent / "results"
POOL_START_LIMIT = 60.0  # seconds for a `local_pool` to come up
STEP_LIMIT = 30.0  # seconds one step (a keystroke, a transfer, a start) may take before a bench gives up


def machine(redis_version: str = "") -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "redis": redis_version,
    }


def save(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    return path


def median(values: list[float]) -> float:
    return statistics.median(values)


def percentile(values: list[float], p: float) -> float:
    """The nearest-rank percentile of `values` (p in 0..100)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def summary_ms(seconds: list[float]) -> dict[str, float]:
    """p50/p90/p99/max of a list of durations in seconds, as milliseconds."""
    if not seconds:
        return {"n": 0, "p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "max": float("nan")}
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
        "max": max(ms),
    }


def bench_env(tmp: str, **extra: str) -> dict[str, str]:
    """Configuration for a bench PoolServer: its own data dir, listener and metrics on free ports."""
    os.environ["XDG_CONFIG_HOME"] = str(Path(tmp) / "xdg")  # the bench's own token and address
    return {
        "GPUPOOL_DATA_DIR": tmp,
        "GPUPOOL_LISTEN": "127.0.0.1:0",
        "GPUPOOL_METRICS_LISTEN": "127.0.0.1:0",
        "GPUPOOL_WEB_LISTEN": "127.0.0.1:0",
        "GPUPOOL_LOG_LEVEL": "warning",
        **extra,
    }


@contextlib.asynccontextmanager
async def bench_server() -> AsyncIterator[PoolServer]:
    """A started PoolServer of its own (embedded Redis, listener on a free port, no local
    workers), stopped on the way out."""
    with tempfile.TemporaryDirectory() as tmp:
        server = PoolServer(config.load(None, env=bench_env(tmp, GPUPOOL_WORKER_LOCAL_PROCESSORS="0")))
        await server.start()
        try:
            assert server.listener is not None
            assert server.queue is not None
            yield server
        finally:
            await server.stop()


@contextlib.contextmanager
def local_pool(tmp: Path, **extra: str) -> Iterator[subprocess.Popen[bytes]]:
    """`poold` as `make run` starts it, on loopback, its data and pools.toml under `tmp`; this
    process's environment then finds it as pools.toml's "local" (XDG_CONFIG_HOME). `extra`:
    settings of its own (GPUPOOL_...). Yields the process, started: wait for it with `ready`."""
    for name in ("GPUPOOL_SERVER", "GPUPOOL_POOL", "GPUPOOL_TOKEN", "GPUPOOL_USER"):
        os.environ.pop(name, None)
    os.environ["XDG_CONFIG_HOME"] = str(tmp / "xdg")
    venv = str(Path(sys.executable).parent)  # as an activated environment: its python, its uv
    if os.environ.get("PATH", "").split(os.pathsep)[0] != venv:
        os.environ["PATH"] = os.pathsep.join([venv, os.environ.get("PATH", "")])
    env = {
        **os.environ,
        "GPUPOOL_DATA_DIR": str(tmp / "data"),
        "GPUPOOL_LISTEN": "127.0.0.1:0",
        "GPUPOOL_METRICS_LISTEN": "127.0.0.1:0",
        "GPUPOOL_WEB_LISTEN": "off",
        "GPUPOOL_WORKER_LOCAL_PROCESSORS": "2",
        # As Slurm here runs a job as its submitter: a root poold's jobs as root, not as slot
        # uids, which could not run this machine's interpreter (under /root, mode 700).
        "GPUPOOL_JOB_UID_RANGE": "root",
        "GPUPOOL_LOG_LEVEL": "warning",
        **extra,
    }
    with open(tmp / "poold.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "daemon.main"], env=env, stdout=log, stderr=log)
    try:
        yield proc
    finally:
        terminate(proc, 30)


def ready(proc: subprocess.Popen[bytes], tmp: Path) -> None:
    """Return once the pool is registered in pools.toml (it registers after its listener and its
    slots have started), else raise with its log."""
    from daemon import pools

    deadline = time.monotonic() + POOL_START_LIMIT
    while not pools.pools_file().exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            log = (tmp / "poold.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"poold did not come up (exit {proc.returncode}):\n{log}")
        time.sleep(0.02)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def bounded(what: str, waited: Awaitable[Any], seconds: float = STEP_LIMIT) -> Any:
    """`waited`'s result, or a TimeoutError naming `what` after `seconds`."""
    try:
        return await asyncio.wait_for(waited, seconds)
    except TimeoutError:
        raise TimeoutError(f"{what}: nothing within {seconds:.0f} s") from None


async def accepting(port: int, what: str, alive: Callable[[], str | None]) -> None:
    """Return once 127.0.0.1:`port` accepts a connection; raise if `alive()` says why it never
    will, or after STEP_LIMIT."""
    deadline = time.monotonic() + STEP_LIMIT
    while True:
        if (why := alive()) is not None:
            raise RuntimeError(f"{what}: {why}")
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: 127.0.0.1:{port} did not accept within {STEP_LIMIT:.0f} s")
        await asyncio.sleep(0.02)


async def stop(proc: asyncio.subprocess.Process) -> None:
    """End a child process of the bench's: SIGTERM, then SIGKILL after 5 s."""
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await asyncio.wait_for(proc.wait(), 5)
