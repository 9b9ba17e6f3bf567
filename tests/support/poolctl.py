"""`poolctl` run as a researcher runs it: a subprocess, in a directory of the test's choosing."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from tests.support.paths import ROOT


async def poolctl(env: dict[str, str], *args: str, cwd: Path | None = None) -> tuple[int, str, str]:
    """`poolctl ARGS` in `cwd` (default: here): exit code, stdout, stderr. Never a traceback."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "daemon.ctl.cli",
        *args,
        cwd=cwd,
        env={**env, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert b"Traceback" not in err, err.decode()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def researcher_env(home: Path, server: str, user: str, token: str) -> dict[str, str]:
    """The environment of a researcher who names the pool by GPUPOOL_SERVER, and nothing else."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / "xdg"),
        "GPUPOOL_SERVER": server,
        "GPUPOOL_USER": user,
        "GPUPOOL_TOKEN": token,
    }
