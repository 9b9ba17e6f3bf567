"""`poolctl ls --format` (squeue -o's columns) and `poolctl completion bash`: the completion
function run in a real bash, as a shell runs it on TAB, with job ids fetched from a real pool."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import pytest

from tests.support.pool import Pool
from tests.support.poolctl import poolctl

POOLCTL = str(Path(sys.executable).with_name("poolctl"))


async def test_ls_format_prints_the_columns_asked_for(pool: Pool) -> None:
    env = pool.env("alice")
    _, out, _ = await poolctl(env, "enqueue", "--name", "train", "--", "true")
    job_id = out.strip()
    code, out, _ = await poolctl(env, "ls", "--format", "id,name,state")
    assert code == 0
    assert out.split("\n")[0].split() == ["ID", "NAME", "STATE"]
    assert out.split("\n")[1].split() == [job_id, "train", "queued"]
    code, out, _ = await poolctl(env, "ls", "--format", "id", "--no-header")
    assert (code, out) == (0, f"{job_id}\n")
    code, _, err = await poolctl(env, "ls", "--format", "id,colour")
    assert (code, err.strip()) == (
        2,
        "poolctl: --format: no column 'colour'; "
        "the columns are id, name, user, queue, state, attempt, worker, waited, ran",
    )


async def complete(env: dict[str, str], words: list[str]) -> list[str]:
    """What bash offers for the last of `words` (the line typed so far), TAB pressed."""
    script = (
        'source <("$POOLCTL" completion bash); '
        'COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); _poolctl; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", script, "bash", *words, env={**env, "POOLCTL": POOLCTL},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    return out.decode().split()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
async def test_bash_completes_commands_options_and_job_ids(pool: Pool) -> None:
    env = pool.env("alice")
    _, out, _ = await poolctl(env, "enqueue", "--", "true")
    job_id = out.strip()
    assert await complete(env, ["poolctl", "s"]) == ["show"]
    assert set(await complete(env, ["poolctl", ""])) >= {
        "enqueue",
        "ls",
        "show",
        "logs",
        "wait",
        "completion",
    }
    assert "--follow" in await complete(env, ["poolctl", "enqueue", "--fo"])
    assert await complete(env, ["poolctl", "show", ""]) == [job_id]
    assert await complete(env, ["poolctl", "logs", "-f", job_id[:10]]) == [job_id]
    # no pool to ask: nothing offered, quickly, and no noise on the terminal
    assert await complete({**env, "GPUPOOL_SERVER": "127.0.0.1:9"}, ["poolctl", "show", ""]) == []
