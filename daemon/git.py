"""Running git: the one way gpupool runs it, for the worker's mirrors (worker/git_mirror.py) and
for what poolctl reads of the user's checkout (ctl/checkout.py).

git runs without a terminal and never asks for a password (a worker has nobody to ask, and a
prompt would hang poolctl in a script), with little of the caller's environment (PASSED_ENV: what
finds programs, keys and proxies; never the daemon's other settings), and reaches only the
protocols it is allowed (GIT_ALLOW_PROTOCOL: never `ext::`, which runs a command, and `file` only
where the caller says a local path is fine). Every failure is a `GitError` whose sentence is the
reason git gave.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from daemon.errors import GpupoolError

PASSED_ENV = frozenset({"PATH", "HOME", "SSH_AUTH_SOCK", "GIT_SSH_COMMAND", "http_proxy", "https_proxy",
                        "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"})  # fmt: skip
NETWORK_PROTOCOLS = "https:ssh:git"  # what a job's repository may be fetched over, on a shared worker
ANY_PROTOCOL = NETWORK_PROTOCOLS + ":file"  # local paths too: one's own machine, and the worker's mirrors


class GitError(GpupoolError):
    """git failed; the sentence is git's own reason."""


async def git(*args: str, cwd: Path | None = None, strip: bool = True, protocols: str = ANY_PROTOCOL) -> str:
    """Run git without a terminal (it must never wait for a password), over `protocols` only; its
    stdout (stripped of surrounding whitespace unless `strip` is False), or GitError."""
    env = {k: v for k, v in os.environ.items() if k in PASSED_ENV}
    env.update(GIT_TERMINAL_PROMPT="0", GIT_ASKPASS="true", LC_ALL="C", GIT_ALLOW_PROTOCOL=protocols)
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
    """The git command in `args`, past the global options (`--git-dir X`, `--work-tree X`, `-C X`)."""
    rest = list(args)
    while rest and rest[0] in ("--git-dir", "--work-tree", "-C"):
        rest = rest[2:]
    return rest[0] if rest else "?"
