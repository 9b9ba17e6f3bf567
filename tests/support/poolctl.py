"""`poolctl` run as a researcher runs it: a subprocess, in a directory of the test's choosing."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from tests.support import unprivileged
from tests.support.paths import ROOT


async def poolctl(
    env: dict[str, str],
    *args: str,
    cwd: Path | None = None,
    user: str | None = None,
    stdin: bytes | None = None,
) -> tuple[int, str, str]:
    """`poolctl ARGS` in `cwd`: exit code, stdout, stderr. Never a traceback. `cwd` by default is
    `/`, in no project (an enqueue from a project sends it with the job: this checkout is one).
    `user`: run as that login user (its uid, gid and groups), as a cluster user runs it. `stdin`:
    piped in (None: /dev/null)."""
    python, path = sys.executable, str(ROOT)
    as_user: list[str] = []
    if user is not None:
        python, path = unprivileged.python(), unprivileged.pythonpath()
        as_user = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups"]
    proc = await asyncio.create_subprocess_exec(
        *as_user,
        python,
        "-m",
        "daemon.ctl.cli",
        *args,
        cwd=cwd or "/",
        env={**env, "PYTHONPATH": path},
        stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60)
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
