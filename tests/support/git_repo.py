"""A real git repository for tests: two commits of version.txt."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

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
