"""Running git: the one way gpupool runs it, for the worker's mirrors (worker/git_mirror.py) and
for what poolctl reads of the user's checkout (ctl/checkout.py).

git runs without a terminal and never asks for a password (a worker has nobody to ask, and a
prompt would hang poolctl in a script); every failure is a `GitError` whose sentence is the reason
git gave.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from daemon.errors import GpupoolError


class GitError(GpupoolError):
    """git failed; the sentence is git's own reason."""


async def git(*args: str, cwd: Path | None = None, strip: bool = True) -> str:
    """Run git without a terminal (it must never wait for a password); its stdout (stripped of
    surrounding whitespace unless `strip` is False), or GitError."""
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0", GIT_ASKPASS="true", LC_ALL="C")
    proc = await asyncio.create_subprocess_exec(
        "git",
        *args,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        lines = [line.strip() for line in err.decode(errors="replace").splitlines() if line.strip()]
        fatal = [line for line in lines if line.startswith(("fatal:", "error:"))]
        reason = (fatal or lines or [f"exit status {proc.returncode}"])[0]
        raise GitError(f"git {_verb(args)} failed: {reason}")
    text = out.decode()
    return text.strip() if strip else text


def _verb(args: tuple[str, ...]) -> str:
    """The git command in `args`, past the global options (`--git-dir X`, `-C X`)."""
    rest = list(args)
    while rest and rest[0] in ("--git-dir", "-C"):
        rest = rest[2:]
    return rest[0] if rest else "?"
