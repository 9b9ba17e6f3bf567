"""`poolctl ls --format` (squeue -o's columns) and `poolctl completion bash|zsh|fish`: each
script run in its real shell, as the shell runs it on TAB, with job ids and queue names fetched from
a real pool through `poolctl completion --words`."""

from __future__ import annotations

import asyncio
import shutil
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from daemon.ctl.completion import ASK_SECONDS
from daemon.queue.registry import Registration, add_heartbeat
from daemon.queue.scripts import ScriptBatch
from protocol import Enqueue, Enqueued
from tests.support.paths import ROOT
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
        "the columns are id, name, user, queue, state, attempt, worker, waited, ran, index, gpus, "
        "priority, exit, reason",
    )


async def run(argv: list[str], env: dict[str, str]) -> str:
    """`argv` run in a throwaway home (no user's shell config can interfere): its output."""
    home = env["HOME"]
    env = {**env, "POOLCTL": POOLCTL, "ZDOTDIR": home, "PYTHONPATH": str(ROOT)}  # this checkout's poolctl
    env |= {f"XDG_{d}_HOME": f"{home}/xdg-{d.lower()}" for d in ("CONFIG", "DATA", "CACHE")}
    proc = await asyncio.create_subprocess_exec(
        *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert (proc.returncode, err.decode()) == (0, "")
    return out.decode()


async def bash(env: dict[str, str], words: list[str]) -> list[str]:
    """What bash offers for the last of `words` (the line typed so far), TAB pressed."""
    script = (
        'source <("$POOLCTL" completion bash); '
        'COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); _poolctl; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    return (await run(["bash", "-c", script, "bash", *words], env)).split()


async def zsh(env: dict[str, str], words: list[str]) -> list[str]:
    """What zsh offers: the function called as the completion system calls it on TAB, `words` and
    `CURRENT` set, with compadd (a builtin only a completion widget may run) shadowed by a function
    that prints the words it is given that match the word being completed, as compadd matches."""
    script = (
        'autoload -Uz compinit && compinit -u -D; source <("$POOLCTL" completion zsh); '
        "compadd() { while (( $# )) && [[ $1 != -- ]]; do shift; done; shift; "
        "print -rl -- ${(M)@:#${words[CURRENT]}*}; }; "
        '_files() { print -r -- "(files)"; }; '
        'words=("$@"); CURRENT=$#; _poolctl'
    )
    return (await run(["zsh", "-f", "-c", script, "zsh", *words], env)).split()


async def fish(env: dict[str, str], words: list[str]) -> list[str]:
    """What fish offers: `complete -C LINE` prints the candidates as TAB would (one a line, each
    maybe followed by a TAB and its description)."""
    script = '"$POOLCTL" completion fish | source; complete -C $argv[1]'
    out = await run(["fish", "-c", script, " ".join(words)], env)
    return [line.split("\t")[0] for line in out.splitlines()]


Complete = Callable[[dict[str, str], list[str]], Awaitable[list[str]]]
SHELLS = [
    pytest.param(c, marks=pytest.mark.skipif(shutil.which(c.__name__) is None, reason=f"needs {c.__name__}"))
    for c in (bash, zsh, fish)
]


async def serving(pool: Pool, worker: str, queues: list[str]) -> None:
    """A worker's registration, as its heartbeat writes it: the pool then knows its queues."""
    batch = ScriptBatch(pool.queue.redis)
    registration = Registration(id=worker, slots=1, queues=queues, healthy_period=30)
    add_heartbeat(batch, pool.queue.scripts, registration)
    await batch.execute()


async def jobs_and_queues(pool: Pool) -> tuple[dict[str, str], list[str]]:
    """A pool with a worker serving gpu and default, a job queued on train (which none serves:
    --wait-for-worker) and a finished one:
    alice's environment, and the two jobs' ids."""
    env = pool.env("alice")
    await serving(pool, "w1", ["gpu", "default"])
    _, out, _ = await poolctl(env, "enqueue", "--queue", "train", "--wait-for-worker", "--", "true")
    queued = out.strip()
    _, out, _ = await poolctl(env, "enqueue", "--", "true")
    finished = out.strip()
    assert (await poolctl(env, "cancel", finished))[0] == 0
    return env, [queued, finished]


async def test_words_are_the_pools_job_ids_and_queue_names(pool: Pool) -> None:
    env, job_ids = await jobs_and_queues(pool)
    assert await poolctl(env, "completion", "--words", "jobs") == (0, "".join(f"{j}\n" for j in job_ids), "")
    assert await poolctl(env, "completion", "--words", "queues") == (0, "default\ngpu\ntrain\n", "")


async def test_words_are_silent_and_quick_when_the_pool_cannot_answer(pool: Pool) -> None:
    env = pool.env("alice")
    with socket.socket() as silent:  # connects (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        for server in ("127.0.0.1:9", "not an address", f"127.0.0.1:{silent.getsockname()[1]}"):
            for kind in ("jobs", "queues"):
                started = time.monotonic()
                result = await poolctl({**env, "GPUPOOL_SERVER": server}, "completion", "--words", kind)
                assert result == (0, "", ""), server
                assert time.monotonic() - started < ASK_SECONDS + 3, server
    assert await poolctl({**env, "GPUPOOL_TOKEN": "wrong"}, "completion", "--words", "jobs") == (0, "", "")
    # for the scripts only: not in any help
    for args in (["--help"], ["completion", "--help"]):
        code, out, _ = await poolctl(env, *args)
        assert code == 0
        assert "--words" not in out


@pytest.mark.parametrize("complete", SHELLS)
async def test_each_shell_completes_commands_options_job_ids_and_queues(
    pool: Pool, complete: Complete
) -> None:
    env, job_ids = await jobs_and_queues(pool)
    assert sorted(await complete(env, ["poolctl", "sh"])) == ["shell", "show"]
    assert set(await complete(env, ["poolctl", ""])) >= {
        "enqueue",
        "ls",
        "show",
        "logs",
        "wait",
        "completion",
    }
    assert "--follow" in await complete(env, ["poolctl", "enqueue", "--fo"])
    assert "--no-header" in await complete(env, ["poolctl", "--server", pool.address, "ls", "--"])
    selects = {"--me", "--user", "--name", "--state", "--yes"}  # issue 47 item 5: cancel by selection
    assert selects <= set(await complete(env, ["poolctl", "cancel", "--"]))
    assert sorted(await complete(env, ["poolctl", "show", ""])) == sorted(job_ids)
    assert await complete(env, ["poolctl", "logs", "-f", job_ids[0][:10]]) == [job_ids[0]]
    assert sorted(await complete(env, ["poolctl", "ls", "-q", ""])) == ["default", "gpu", "train"]
    assert await complete(env, ["poolctl", "enqueue", "--queue", "g"]) == ["gpu"]
    assert sorted(await complete(env, ["poolctl", "completion", ""])) == ["bash", "fish", "zsh"]
    # no pool to ask: nothing offered, quickly, and no noise on the terminal (run checks stderr)
    down = {**env, "GPUPOOL_SERVER": "127.0.0.1:9"}
    started = time.monotonic()
    assert await complete(down, ["poolctl", "show", ""]) == []
    assert await complete(down, ["poolctl", "ls", "--queue", ""]) == []
    assert time.monotonic() - started < 2 * ASK_SECONDS


async def test_cancel_is_offered_what_can_be_cancelled_and_pool_the_pools(pool: Pool) -> None:
    """Issue 47 item 9: `cancel` was offered every job, finished ones and other users' too (each
    refused), and the word after `--pool` was offered poolctl's commands. `cancel` is offered
    the user's own jobs that have not ended; `--pool`, the pools named in pools.toml; the value
    of --server and --tls-ca, never a command. In bash (zsh and fish share the table; each costs
    seconds more)."""
    complete = bash
    env, (queued, _finished) = await jobs_and_queues(pool)
    async with pool.client("bob") as bob:
        await bob.call(Enqueue({"argv": ["true"]}, None), Enqueued)
    assert await complete(env, ["poolctl", "cancel", ""]) == [queued]
    assert await complete(env, ["poolctl", "cancel", "--json", queued, ""]) == [queued]
    pools_toml = Path(env["HOME"], "xdg-config", "gpupool", "pools.toml")
    pools_toml.parent.mkdir(parents=True)
    pools_toml.write_text('[pools.lab]\nserver = "lab:7420"\n[pools.gpu-head]\nserver = "gpu:7420"\n')
    assert sorted(await complete(env, ["poolctl", "--pool", ""])) == ["gpu-head", "lab"]
    assert await complete(env, ["poolctl", "--pool", "l"]) == ["lab"]
    for option in ("--server", "--tls-ca"):
        assert not {"ls", "cancel", "enqueue"} & set(await complete(env, ["poolctl", option, ""]))
