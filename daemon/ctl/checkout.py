"""What poolctl reads of the user's git checkout: the exact commit `--git` names, and the files
`--snapshot` packs.

Both pin what the job runs when it is submitted, so later commits or edits change nothing: `--git`
without a repository resolves this checkout's origin (or its path, for a pool on this machine) at
the commit HEAD (or `--ref`) is now; `--snapshot` takes the working tree as it is, uncommitted and
untracked-but-not-ignored files included. Every git call goes through daemon/git.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from daemon.git import GitError, git
from daemon.job import FULL_SHA
from protocol import ErrorCode


class NotACheckout(GitError):
    """The option needs a git checkout where poolctl runs, and there is none (or git failed there)."""

    code = ErrorCode.INVALID_ARGUMENT


async def _in_checkout(option: str, cwd: Path | None, *args: str, strip: bool = True) -> str:
    try:
        return await git(*args, cwd=cwd, strip=strip)
    except GitError as exc:
        raise NotACheckout(f"{option} needs a git checkout here: {exc}") from None


async def git_source(repo: str, ref: str | None, cwd: Path | None = None) -> dict[str, str]:
    """The spec's `git` entry for `--git [REPO] [--ref REF]`. With REPO, a full commit id is pinned as
    given and anything else is a ref the worker resolves; without REPO, this checkout at the exact
    commit HEAD (or REF) names now, with a warning on stderr for what the job will not see."""
    if repo:
        return (
            {"repo": repo, "commit": ref}
            if ref and FULL_SHA.fullmatch(ref)
            else {"repo": repo, "ref": ref or "HEAD"}
        )

    async def run(*args: str) -> str:
        return await _in_checkout("--git without a repository", cwd, *args)

    top = await run("rev-parse", "--show-toplevel")
    commit = await run("rev-parse", "--verify", f"{ref or 'HEAD'}^{{commit}}")
    remotes = (await run("remote")).split()
    source = await run("remote", "get-url", "origin") if "origin" in remotes else top
    if await run("status", "--porcelain", "--untracked-files=no"):
        print(
            "poolctl: uncommitted changes are not part of the job: it runs commit " + commit[:12],
            file=sys.stderr,
        )
    if "origin" in remotes and not await run("branch", "-r", "--contains", commit):
        print(
            f"poolctl: commit {commit[:12]} is on no branch of origin: push it, or no worker can fetch it",
            file=sys.stderr,
        )
    return {"repo": source, "commit": commit}


@dataclass(frozen=True, slots=True)
class WorkingTree:
    """A checkout's files as they are now, for `--snapshot`."""

    top: Path
    names: tuple[str, ...]  # committed, modified and untracked-but-not-ignored, relative to `top`
    commit: str  # HEAD's commit, "" in a repository without commits
    dirty: bool  # the files differ from `commit`


async def working_tree(cwd: Path) -> WorkingTree:
    top = Path(await _in_checkout("--snapshot", cwd, "rev-parse", "--show-toplevel"))
    try:
        commit = await git("rev-parse", "--verify", "-q", "HEAD", cwd=top)
    except GitError:
        commit = ""  # no commit yet: the snapshot is all untracked files
    listed = await _in_checkout("--snapshot", top, "ls-files", "-co", "--exclude-standard", "-z", strip=False)
    dirty = bool(await _in_checkout("--snapshot", top, "status", "--porcelain"))
    return WorkingTree(top, tuple(n for n in listed.split("\0") if n), commit, dirty)
