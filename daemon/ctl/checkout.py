"""What poolctl reads of the user's git checkout for `--git`: the exact commit it names.

It pins what the job runs when it is submitted, so later commits change nothing: `--git` without
a repository resolves this checkout's origin (or its path, for a pool on this machine) at the
commit HEAD (or `--ref`) is now; a commit that origin lacks is refused, since no worker could
fetch it. (The working tree as it is, uncommitted files included, goes with a job by default:
daemon/ctl/project.py.) Every git call goes through daemon/git.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

from daemon.git import GitError, git
from daemon.spec_checks import FULL_SHA
from protocol import ErrorCode


class NotACheckout(GitError):
    """The option needs a git checkout where poolctl runs, and there is none (or git failed there)."""

    code = ErrorCode.INVALID_ARGUMENT


class UnpushedCommit(GitError):
    """`--git` without a repository names a commit its origin lacks: a job pinned to it would be
    queued only to fail, since no worker can fetch it."""

    code = ErrorCode.INVALID_ARGUMENT


async def _in_checkout(option: str, cwd: Path | None, *args: str, strip: bool = True) -> str:
    try:
        return await git(*args, cwd=cwd, strip=strip)
    except GitError as exc:
        raise NotACheckout(f"{option} needs a git checkout here: {exc}") from None


async def git_source(repo: str, ref: str | None, cwd: Path | None = None) -> dict[str, str]:
    """The spec's `git` entry for `--git [REPO] [--ref REF]`. With REPO, a full commit id is pinned as
    given and anything else is a ref the worker resolves; without REPO, this checkout at the exact
    commit HEAD (or REF) names now, with a warning on stderr for uncommitted changes, which the job
    will not see; UnpushedCommit if origin lacks that commit."""
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
    if "origin" in remotes and not await run("branch", "-r", "--contains", commit):
        raise UnpushedCommit(
            f"--git: commit {commit[:12]} is on no branch of origin, so no worker can fetch "
            "it; the job was not queued: push it first (git push), pass --ref with a commit "
            "origin has, or leave --git out to send the working tree with the job"
        )
    if await run("status", "--porcelain", "--untracked-files=no"):
        print(
            "poolctl: uncommitted changes are not part of the job: it runs commit " + commit[:12],
            file=sys.stderr,
        )
    return {"repo": source, "commit": commit}
