"""A real git repository for tests: two commits of version.txt; and a real `git daemon` serving
repositories over git://, as slowly as a test needs."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from daemon.queue.embedded_redis import free_port
from tests.support.processes import terminate

DAEMON_START_TIMEOUT = 10.0  # until git daemon accepts connections

GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
}


def git(repo: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, check=True, env={**os.environ, **GIT_ENV}
    )
    return out.stdout.strip()


def make_repo(path: Path) -> tuple[str, str]:
    """A repository with two commits of version.txt: 'one', then 'two'. Returns both commit ids."""
    path.mkdir()
    git(path, "init", "--quiet", "--initial-branch=main")
    commits = []
    for text in ("one", "two"):
        (path / "version.txt").write_text(text + "\n")
        git(path, "add", "version.txt")
        git(path, "commit", "--quiet", "-m", text)
        commits.append(git(path, "rev-parse", "HEAD"))
    return commits[0], commits[1]


@contextlib.contextmanager
def git_daemon(base: Path, delay: float = 0.0) -> Iterator[str]:
    """A `git daemon` on a free loopback port serving every repository under `base`; each fetch
    is served `delay` seconds after it asks (its access hook sleeps first): a slow server, for
    a job whose code takes that long to come. Yields the URL of `base` (git://127.0.0.1:PORT/);
    the daemon is stopped at the end."""
    hook = base / "slow-hook"
    hook.write_text(f"#!/bin/sh\nsleep {delay:g}\n")
    hook.chmod(0o755)
    port = free_port()
    argv = [
        "git", "daemon", "--reuseaddr", "--listen=127.0.0.1", f"--port={port}", f"--base-path={base}",
        "--export-all", f"--access-hook={hook}", str(base),
    ]  # fmt: skip
    with open(base / "git-daemon.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + DAEMON_START_TIMEOUT
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"git daemon did not start: {(base / 'git-daemon.log').read_text()}")
            time.sleep(0.05)
        yield f"git://127.0.0.1:{port}/"
    finally:
        terminate(proc, 10)
