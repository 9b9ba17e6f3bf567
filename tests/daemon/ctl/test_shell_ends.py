"""Issue 49: how a `poolctl shell` ends, other than by its own `exit`, on a real pool server, a real
`poold --worker` running its jobs as slot uids (test_exec.py's) and `poolctl` on a real PTY
(test_shell.py's): every way tells the user what ended it, and none leaves a shell running
with nobody at it. One pool and worker for the module; the worker's drain comes last."""

from __future__ import annotations

import asyncio
import math
import os
import shlex
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from subprocess import Popen

import pexpect
import pytest

from daemon.errors import InvalidJob
from daemon.job import JobSpec, JobState
from daemon.queue import registry
from daemon.queue.embedded_redis import EmbeddedRedis
from protocol import ChannelResize, LocalProtocolError, OpenChannel
from storage.s3 import S3Store
from tests.daemon.ctl.test_exec import gpu_worker
from tests.daemon.ctl.test_shell import PROMPT, QUEUED, SHELL, ended, expect, poolctl_on_a_pty
from tests.support.paths import ROOT
from tests.support.pool import Pool, running_pool
from tests.support.s3server import S3Server
from tests.support.workers import wait_state, wait_until

IDLE_LIMIT = 5  # the worker's shell_idle_limit: every shell here has activity more often
S3_SETTINGS = ("ADDRESS", "BUCKET", "ACCESS_KEY_ID", "SECRET_ACCESS_KEY")


@asynccontextmanager
async def pool_and_worker(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> AsyncIterator[tuple[Pool, Popen[bytes]]]:
    store = S3Store(*(s3_env[f"GPUPOOL_MAIN_SERVER_MINIO_{name}"] for name in S3_SETTINGS))
    async with running_pool(redis_server, tmp_path, store=store) as pool:  # (the workers' bucket)
        with gpu_worker(
            redis_server, tmp_path / "worker.log", s3_env, "--shell-idle-limit", str(IDLE_LIMIT)
        ) as worker:

            async def registered() -> bool:
                return len(await registry.list_workers(pool.queue.redis)) == 1

            await wait_until(registered, 30, "the worker to register")
            yield pool, worker


async def ctrl_c_while_a_shell_starts_cancels_it(
    pool: Pool, worker: Popen[bytes], s3_server: S3Server, project: Path
) -> None:
    """Issue 49, review 49b finding 2: Ctrl-C while a shell's job runs but its shell is not
    started yet (its project still coming: the store hangs) cancels the job, as while it is
    queued, and poolctl says so and exits 130; it left the job running, with nobody at it."""
    (project / "pyproject.toml").write_text('[project]\nname = "shell-project"\n')  # (a project's mark)
    (project / "train.py").write_text("print('a project for its shell')\n")
    env = {**pool.env("alice"), "PYTHONPATH": str(ROOT), "TERM": "dumb"}
    worker.send_signal(signal.SIGSTOP)  # nothing claims it until its project has been sent
    try:
        shell = pexpect.spawn(
            sys.executable, ["-m", "daemon.ctl.cli", "shell", "--no-env", *SHELL],
            env=env, cwd=str(project), dimensions=(24, 80), timeout=30, encoding="utf-8",
        )  # fmt: skip
        job_id = await expect(shell, QUEUED)
    finally:
        worker.send_signal(signal.SIGCONT)
    with s3_server.paused():  # its project cannot be fetched: the job runs, its shell does not
        await expect(shell, f"poolctl: {job_id} is starting")
        shell.sendcontrol("c")
        await expect(shell, f"poolctl: {job_id} cancelled before its shell started")
        assert await ended(shell) == 130
    await wait_state(pool.queue, job_id, JobState.CANCELLED, timeout=15)


async def a_shell_of_a_quick_command_shows_its_output_and_exits_with_its_code(pool: Pool) -> None:
    """Issue 49, review 49b finding 3: `shell -- CMD` whose command ends before any attach (it
    said "failed before its shell started", exit 1, its output and code lost) shows what it wrote
    (its log) and exits with its code; one whose program never ran says why (the job's detail)."""
    said = poolctl_on_a_pty(pool, "alice", "shell", "--", "sh", "-c", "echo quick-$((1+1)); exit 7")
    true = poolctl_on_a_pty(pool, "alice", "shell", "--", "true")
    missing = poolctl_on_a_pty(pool, "alice", "shell", "--", "/nonexistent")
    await expect(said, "quick-2")
    assert await ended(said) == 7
    assert await ended(true) == 0
    await expect(missing, r"failed before its shell started: cannot start '/nonexistent'")
    assert await ended(missing) == 1


async def a_requeue_ends_a_shell_saying_so(pool: Pool) -> None:
    """Issue 49, review 49b finding 1, a requeue: as a drain (below), it ends an attached shell
    FAILED, saying so, rather than hand it back to start again with nobody at it."""
    shell = poolctl_on_a_pty(pool, "alice", "shell", *SHELL)
    job_id = await expect(shell, QUEUED)
    await expect(shell, PROMPT)
    await pool.queue.requeue(job_id)
    await expect(shell, f"poolctl: {job_id}: requeued by its user; a shell is not requeued")
    assert await ended(shell) == 128 + signal.SIGHUP
    info = await wait_state(pool.queue, job_id, JobState.FAILED, JobState.QUEUED, timeout=15)
    assert (info.state, info.attempt) == (JobState.FAILED, 1)


async def a_signal_to_poolctl_detaches_and_restores_the_terminal(pool: Pool, job_id: str) -> None:
    """Issue 49, review 49b finding 4: SIGTERM, SIGHUP or SIGQUIT to an attached poolctl detach
    it, its terminal's mode restored (it was left raw: no echo, no line editing), and it exits
    128+N; the shell runs on."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        line = shlex.join([sys.executable, "-m", "daemon.ctl.cli", "attach", job_id])
        then = "echo poolctl-exited-$?; stty -a | tr ' ' '\\n' | grep -x -- '-\\?icanon'; echo mode-said"
        wrapped = pexpect.spawn(
            "sh", ["-c", f"{line}; {then}"], cwd="/",
            env={**pool.env("alice"), "PYTHONPATH": str(ROOT), "TERM": "dumb"},
            dimensions=(24, 80), timeout=30, encoding="utf-8",
        )  # fmt: skip
        await expect(wrapped, PROMPT)  # (the session's tail, replayed: attached)
        wrapped.sendline("echo attached-$((3+4))")
        await expect(wrapped, "attached-7")
        poolctl_pid = int(Path(f"/proc/{wrapped.pid}/task/{wrapped.pid}/children").read_text().split()[0])
        os.kill(poolctl_pid, sig)
        await expect(wrapped, f"poolctl-exited-{128 + sig}")
        assert await expect(wrapped, r"(-?icanon)\s+mode-said") == "icanon"  # (-icanon: raw still)
        assert await ended(wrapped) == 0
    assert (await pool.queue.get(job_id)).state is JobState.RUNNING


async def a_window_of_no_rows_keeps_the_attach_typing(pool: Pool, job_id: str) -> None:
    """Issue 49, review 49b finding 5: a window of 0 rows (as some terminals say while they are
    drawn) is an unknown size: attached, the resize is left out and what is typed still reaches
    the shell (all input was lost, silently); an attach from such a window is no longer refused;
    and a channel whose input fails to be sent fails with that error (it went on without input)."""
    attached = poolctl_on_a_pty(pool, "alice", "attach", job_id)
    await expect(attached, PROMPT)
    attached.setwinsize(0, 80)
    await asyncio.sleep(0.3)  # (its SIGWINCH handled)
    attached.sendline("echo typed-$((2+2))")
    await expect(attached, "typed-4")
    attached.send("\r~.")
    assert await ended(attached) == 0
    env = {**pool.env("alice"), "PYTHONPATH": str(ROOT), "TERM": "dumb"}
    unsized = pexpect.spawn(
        sys.executable, ["-m", "daemon.ctl.cli", "attach", job_id],
        env=env, cwd="/", dimensions=(0, 80), timeout=30, encoding="utf-8",
    )  # fmt: skip
    await expect(unsized, PROMPT)
    unsized.sendline("echo unsized-$((3+3))")
    await expect(unsized, "unsized-6")
    unsized.send("\r~.")
    assert await ended(unsized) == 0

    async def unsendable() -> AsyncIterator[bytes | ChannelResize]:  # (a client that sends 0 rows)
        yield ChannelResize(0, 80)
        await asyncio.Event().wait()

    async def shown(stream: str, data: bytes) -> None:
        del stream, data

    async with pool.client("alice") as client:  # what fails a channel's input fails the channel
        request = OpenChannel(job_id, "attach", [], stdin=True)
        with pytest.raises(LocalProtocolError):
            await asyncio.wait_for(client.channel(request, shown, unsendable()), 10)


async def an_attach_counts_as_activity_and_the_pools_idle_limit_caps_a_shells(pool: Pool) -> None:
    """Issue 49, review 49b finding 7: the idle limit counts an attach as its user's activity (a
    shell attached to a while before its limit was ended under its user); and the worker's
    shell_idle_limit is a cap: `--idle 1e300` is that limit (it opted out of it), and a raw
    spec's infinite limit is refused."""
    shell = poolctl_on_a_pty(pool, "alice", "shell", "--idle", "1e300", *SHELL)
    job_id = await expect(shell, QUEUED)
    await expect(shell, PROMPT)
    started = time.monotonic()  # (its limit counts from before: its terminal's start)
    shell.send("~.")
    assert await ended(shell) == 0
    await asyncio.sleep(started + 3 - time.monotonic())
    again = poolctl_on_a_pty(pool, "alice", "attach", job_id)
    await expect(again, PROMPT)
    await asyncio.sleep(started + IDLE_LIMIT + 1 - time.monotonic())
    assert (await pool.queue.get(job_id)).state is JobState.RUNNING  # its attach counted
    await expect(again, f"poolctl: {job_id}: ended: no input for {IDLE_LIMIT} s", timeout=10)
    assert await ended(again) == 128 + signal.SIGHUP
    with pytest.raises(InvalidJob, match="idle_limit: must be a positive number of seconds, not inf"):
        JobSpec.from_dict({"argv": ["sh"], "tty": True, "idle_limit": math.inf})


async def a_cancel_ends_an_attached_shell_saying_so(pool: Pool, job_id: str) -> None:
    """Issue 49, review 49b finding 6: a cancel while attached ends poolctl saying what ended its
    shell (it said nothing, the end read as the shell's own exit), with 128+N for the signal N
    that stopped it (SIGHUP, a shell's stop signal)."""
    attached = poolctl_on_a_pty(pool, "alice", "attach", job_id)
    await expect(attached, PROMPT)
    await pool.queue.cancel(job_id)
    await expect(attached, f"poolctl: {job_id}: cancelled")
    assert await ended(attached) == 128 + signal.SIGHUP
    assert (await wait_state(pool.queue, job_id, JobState.CANCELLED)).state is JobState.CANCELLED


async def a_shell_no_one_can_attach_to_is_cancelled(pool: Pool, worker: Popen[bytes]) -> None:
    """Issue 49, review 49b finding 8: a shell whose job an agent's machine claimed (where no
    attach reaches) is cancelled by the `poolctl shell` that queued it, saying so: it was left
    running there, its GPUs held, with nobody able to use it."""
    worker.send_signal(signal.SIGSTOP)  # (the agent claims it, not this worker)
    try:
        shell = poolctl_on_a_pty(pool, "alice", "shell", *SHELL)
        job_id = await expect(shell, QUEUED)
        agent = registry.agent_worker_id("laptop")
        lease = await pool.queue.claim(agent, ["default"])
        assert lease is not None
        assert lease.job_id == job_id
    finally:
        worker.send_signal(signal.SIGCONT)
    await expect(shell, f"runs on an agent's machine \\({agent}\\), where attach is not supported yet")
    await expect(shell, f"poolctl cancelled {job_id}: no attach reaches it there")
    assert await ended(shell) == 2
    assert (await pool.queue.get(job_id)).cancel_requested


async def a_drain_ends_an_attached_shell_saying_so(pool: Pool, worker: Popen[bytes]) -> None:
    """Issue 49, review 49b finding 1: the worker's drain (SIGTERM) does not hand an attached
    shell back to the queue, where it would start again elsewhere with nobody at it while
    poolctl exited without a word: its job ends FAILED, saying why, and poolctl says so too."""
    shell = poolctl_on_a_pty(pool, "alice", "shell", *SHELL)
    job_id = await expect(shell, QUEUED)
    await expect(shell, PROMPT)
    shell.sendline("echo working-$((5+5))")
    await expect(shell, "working-10")
    worker.send_signal(signal.SIGTERM)
    await expect(shell, f"poolctl: {job_id}: the worker is stopping; a shell is not requeued")
    assert await ended(shell) == 128 + signal.SIGHUP  # (its shell hung up: a shell's stop signal)
    info = await wait_state(pool.queue, job_id, JobState.FAILED, JobState.QUEUED, timeout=15)
    assert info.state is JobState.FAILED
    assert "the worker is stopping; a shell is not requeued" in info.detail


async def test_a_shell_ended_by_anything_but_its_exit_says_what_ended_it(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_server: S3Server, s3_env: dict[str, str]
) -> None:
    """Issue 49, `shell` done-when (review 49b): each way a shell ends, in turn on one pool."""
    async with pool_and_worker(redis_server, tmp_path, s3_env) as (pool, worker):
        project = tmp_path / "project"
        project.mkdir()
        await ctrl_c_while_a_shell_starts_cancels_it(pool, worker, s3_server, project)
        # The idle limit's step waits on its clock, meanwhile the others run (the worker's own
        # stops, below, come after it).
        idling = asyncio.ensure_future(
            an_attach_counts_as_activity_and_the_pools_idle_limit_caps_a_shells(pool)
        )
        await asyncio.gather(
            a_shell_of_a_quick_command_shows_its_output_and_exits_with_its_code(pool),
            a_requeue_ends_a_shell_saying_so(pool),
        )
        shell = poolctl_on_a_pty(pool, "alice", "shell", *SHELL)
        job_id = await expect(shell, QUEUED)
        await expect(shell, PROMPT)
        shell.send("~.")
        assert await ended(shell) == 0
        await a_signal_to_poolctl_detaches_and_restores_the_terminal(pool, job_id)
        await a_window_of_no_rows_keeps_the_attach_typing(pool, job_id)
        await a_cancel_ends_an_attached_shell_saying_so(pool, job_id)
        await idling
        await a_shell_no_one_can_attach_to_is_cancelled(pool, worker)
        await a_drain_ends_an_attached_shell_saying_so(pool, worker)
