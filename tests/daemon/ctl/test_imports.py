"""`poolctl` loads only what it uses: a real run, in a fresh interpreter, against a real pool, never
imports what daemon/ctl/ruff.toml bans (Redis, the S3 client, NVML, the metrics library, the
daemon's rooms). Ruff checks the import lines of ctl/; this checks what a run actually loads,
including what the shared modules it imports pull in."""

from __future__ import annotations

import asyncio
import sys
import tomllib
from pathlib import Path

import orjson
import pytest

from tests.support.paths import ROOT
from tests.support.pool import Pool

# Run poolctl's main, then write every module the run loaded to the file named by argv[1].
RUN_AND_LIST = """
import sys, json
out, argv = sys.argv[1], sys.argv[2:]
try:
    from daemon.ctl.cli import main
    code = main(argv)
except SystemExit as exc:
    code = exc.code
with open(out, "w") as f:
    json.dump(sorted(sys.modules), f)
sys.exit(code)
"""


def banned() -> list[str]:
    rules = tomllib.loads((ROOT / "daemon" / "ctl" / "ruff.toml").read_text())
    return sorted(rules["lint"]["flake8-tidy-imports"]["banned-api"])


async def loaded_by(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[int, str, list[str]]:
    """poolctl ARGS run in a fresh interpreter: its exit code, its output, the modules it loaded."""
    listing = tmp_path / "modules.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", RUN_AND_LIST, str(listing), *args, env={**env, "PYTHONPATH": str(ROOT)},
        cwd="/",  # in no project: an enqueue from this checkout would send it with the job
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert b"Traceback" not in err, err.decode()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), orjson.loads(listing.read_bytes())


def forbidden(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == b or m.startswith(b + ".") for b in banned())]


def test_the_banned_list_names_what_the_issue_asks() -> None:
    assert {"redis", "aiobotocore", "daemon.queue", "daemon.server", "daemon.worker"} <= set(banned())


@pytest.mark.parametrize(
    "args",
    [("--help",), ("enqueue", "--", "true"), ("ls",), ("show", "JOB")],
    ids=["help", "enqueue", "ls", "show"],
)
async def test_poolctl_loads_nothing_it_does_not_use(
    pool: Pool, tmp_path: Path, args: tuple[str, ...]
) -> None:
    env = pool.env("alice")
    if args == ("show", "JOB"):
        code, job_id, _ = await loaded_by(tmp_path, env, "enqueue", "--", "true")
        assert code == 0
        args = ("show", job_id.strip())
    code, out, modules = await loaded_by(tmp_path, env, *args)
    assert code == 0
    assert out  # it did run poolctl: usage, a job id, a table, a job's record
    assert "daemon.ctl.cli" in modules
    assert forbidden(modules) == []


# What a one-request command never needs (issue 15: a command's start is mostly its imports): an
# event loop (one_shot.py asks over a blocking socket), the data mover's HTTP client, the terminal
# renderer when piped, TLS on loopback, dataclasses (9 ms: protocol/record.py replaces it), the
# server's TOML writer.
NOT_FOR_ONE_REQUEST = ("asyncio", "aiohttp", "rich", "ssl", "dataclasses", "tomlkit")


@pytest.mark.parametrize(
    "args",
    [
        ("enqueue", "--", "true"),
        ("ls",),
        ("show", "JOB"),
        ("workers",),
        ("cancel", "JOB"),
        ("wait", "--timeout", "0.1", "JOB"),  # no worker here: it times out (124), having asked
        ("top", "-n", "1"),  # streamed, piped: the views as text
        ("ls", "--watch", "1", "-n", "1"),
    ],
    ids=["enqueue", "ls", "show", "workers", "cancel", "wait", "top", "ls-watch"],
)
async def test_a_one_request_command_loads_no_event_loop_http_client_or_terminal_renderer(
    pool: Pool, tmp_path: Path, args: tuple[str, ...]
) -> None:
    env = pool.env("alice")
    if "JOB" in args:
        code, job_id, _ = await loaded_by(tmp_path, env, "enqueue", "--", "true")
        assert code == 0
        args = tuple(job_id.strip() if a == "JOB" else a for a in args)
    code, out, modules = await loaded_by(tmp_path, env, *args)
    assert (code, bool(out)) == (124 if args[0] == "wait" else 0, True)
    assert [m for m in modules if m.split(".")[0] in NOT_FOR_ONE_REQUEST] == []
