"""Jobs from a git source run at the exact commit, from a mirror that fetches only what is missing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from daemon.errors import InvalidJob
from daemon.git import NETWORK_PROTOCOLS
from daemon.job import JobSpec, JobState
from daemon.queue.job_queue import JobQueue
from tests.support.git_repo import make_repo
from tests.support.workers import running_worker, wait_state


def cat_job(repo: Path, **source: str) -> JobSpec:
    return JobSpec(argv=("cat", "version.txt"), git={"repo": str(repo), **source})


async def output(queue: JobQueue, job_id: str) -> str:
    return b"".join(data for _, data in await queue.read_log(job_id)).decode()


async def test_a_job_runs_at_its_exact_commit_and_the_mirror_is_reused(
    queue: JobQueue, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    first, second = make_repo(repo)
    old, _ = await queue.enqueue(cat_job(repo, commit=first))
    new, _ = await queue.enqueue(cat_job(repo, ref="main"))
    async with running_worker(queue, tmp_path / "w"):
        assert (await wait_state(queue, old, JobState.SUCCEEDED)).exit_code == 0
        await wait_state(queue, new, JobState.SUCCEEDED)
        assert "one\n" in await output(queue, old)  # the exact commit, though main has moved on
        assert f"at {first}" in await output(queue, old)
        assert "two\n" in await output(queue, new)
        assert f"at {second}" in await output(queue, new)
        # the repository goes away: a commit the mirror holds still runs (nothing is fetched)
        shutil.rmtree(repo)
        again, _ = await queue.enqueue(cat_job(repo, commit=first))
        assert "one\n" in await output(queue, (await wait_state(queue, again, JobState.SUCCEEDED)).id)
        # a ref must be fetched, and now cannot be: the attempt fails with git's reason
        gone, _ = await queue.enqueue(cat_job(repo, ref="main"))
        info = await wait_state(queue, gone, JobState.FAILED)
    assert info.detail.startswith("git fetch failed:")


async def test_an_unknown_ref_fails_the_attempt_with_the_reason(queue: JobQueue, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    make_repo(repo)
    job_id, _ = await queue.enqueue(cat_job(repo, ref="no-such-branch"))
    async with running_worker(queue, tmp_path / "w"):
        info = await wait_state(queue, job_id, JobState.FAILED)
    assert "'no-such-branch' is not a commit or ref of" in info.detail


async def test_a_shared_workers_job_cannot_clone_a_path_of_the_workers_disk(
    queue: JobQueue, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    make_repo(repo)
    for source in (str(repo), f"file://{repo}", f"ext::sh -c touch% {tmp_path}/ran"):
        job_id, _ = await queue.enqueue(JobSpec(argv=("true",), git={"repo": source, "ref": "main"}))
        async with running_worker(queue, tmp_path / "w", git_protocols=NETWORK_PROTOCOLS):
            info = await wait_state(queue, job_id, JobState.FAILED)
        assert "not allowed" in info.detail, info.detail
    assert not (tmp_path / "ran").exists()


def test_git_specs_are_validated() -> None:
    with pytest.raises(InvalidJob, match="40-digit"):
        JobSpec.from_dict({"argv": ["x"], "git": {"repo": "r", "commit": "abc"}})
    with pytest.raises(InvalidJob, match="cwd"):
        JobSpec.from_dict({"argv": ["x"], "git": {"repo": "r", "ref": "main"}, "cwd": "/tmp"})
    with pytest.raises(InvalidJob, match="option"):
        JobSpec.from_dict({"argv": ["x"], "git": {"repo": "--upload-pack=touch /tmp/x", "ref": "main"}})
    with pytest.raises(InvalidJob, match="needs a"):
        JobSpec.from_dict({"argv": ["x"], "git": {"repo": "r"}})
