"""`poolctl` run as a researcher runs it: a subprocess, in a directory of the test's choosing."""

from __future__ import annotations

import asyncio
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
