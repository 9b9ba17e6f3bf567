"""Code from git for a job: a job can name a repository and an exact commit (or a ref) to run at.

The worker keeps one bare mirror per repository under its data directory and fetches only what is
missing: an exact commit already in the mirror costs no network at all; a ref (a branch name) is
fetched each time, since it moves. The job's directory is a local clone of the mirror (objects
hard-linked, not copied) checked out at the detached commit. Mirrors are locked per repository, within
the process and across processes (flock), so concurrent jobs never fetch into one mirror at once.
Every failure is a `GitError` with the reason git gave, which fails the attempt with that sentence.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

from daemon.git import ANY_PROTOCOL, GitError, git
from daemon.spec_checks import FULL_SHA

_locks: dict[Path, asyncio.Lock] = {}


def mirror_path(cache: Path, repo: str) -> Path:
    return cache / (hashlib.sha256(repo.encode()).hexdigest()[:20] + ".git")


@contextlib.asynccontextmanager
async def _locked(mirror: Path) -> AsyncIterator[None]:
    lock = _locks.setdefault(mirror, asyncio.Lock())
    async with lock:
        mirror.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(mirror) + ".lock", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock


async def _resolve(mirror: Path, rev: str) -> str | None:
    try:
        return await git("--git-dir", str(mirror), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except GitError:
        return None


async def fetch(cache: Path, repo: str, rev: str, protocols: str = ANY_PROTOCOL) -> tuple[Path, str]:
    """The mirror of `repo`, holding `rev` (a commit or a ref), and the commit `rev` names;
    `repo` is fetched over `protocols` only (daemon/git.py)."""
    mirror = mirror_path(cache, repo)
    async with _locked(mirror):
        if not mirror.exists():
            tmp = mirror.with_name(mirror.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            await git("clone", "--quiet", "--mirror", "--", repo, str(tmp), protocols=protocols)
            tmp.rename(mirror)
        elif not FULL_SHA.fullmatch(rev) or await _resolve(mirror, rev) is None:
            await git("--git-dir", str(mirror), "fetch", "--quiet", "--prune", "origin", protocols=protocols)
        commit = await _resolve(mirror, rev)
    if commit is None:
        raise GitError(f"{rev!r} is not a commit or ref of {repo} (fetched it; is it pushed?)")
    return mirror, commit


async def checkout(cache: Path, repo: str, rev: str, dest: Path, protocols: str = ANY_PROTOCOL) -> str:
    """Put `repo` at `rev` into the empty directory `dest`; returns the exact commit. The job's
    clone is of the worker's own mirror, a local path, whatever `protocols` allows for `repo`."""
    mirror, commit = await fetch(cache, repo, rev, protocols)
    # A local clone hard-links the mirror's objects (read-only, the worker's): the job reads them
    # without any path into the mirror, which a job with a uid of its own cannot reach.
    await git("clone", "--quiet", "--no-checkout", str(mirror), str(dest))
    # The repository is named, not discovered: with job uids, `dest` is the slot uid's and git
    # refuses to discover a repository in a directory another user owns ("dubious ownership"),
    # a guard against a stranger's hooks and config. This one the worker has just made itself,
    # while no process of that uid runs (the slot's last job ended with all of its uid's).
    await git(
        "--git-dir", str(dest / ".git"), "--work-tree", str(dest), "checkout", "--quiet", "--detach", commit
    )
    return commit
