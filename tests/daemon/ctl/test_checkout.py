"""What poolctl reads of the user's checkout: `--git` without a repository pins this checkout's
commit, warns of what the job will not see, and refuses a commit its origin lacks (that one:
test_poolctl.py, through poolctl)."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.ctl.checkout import git_source
from tests.support.git_repo import make_repo


async def test_git_without_a_repository_captures_this_checkout_at_its_commit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = tmp_path / "repo"
    first, second = make_repo(repo)
    assert await git_source("", None, cwd=repo) == {"repo": str(repo), "commit": second}
    assert await git_source("", first[:8], cwd=repo) == {"repo": str(repo), "commit": first}
    (repo / "version.txt").write_text("dirty\n")
    await git_source("", None, cwd=repo)
    assert "uncommitted changes are not part of the job" in capsys.readouterr().err
    assert await git_source("https://example.invalid/r.git", "v1") == {
        "repo": "https://example.invalid/r.git",
        "ref": "v1",
    }
    assert await git_source("r", first) == {"repo": "r", "commit": first}
