"""What poolctl prints of fields other users wrote: never a control sequence, never rich markup,
piped or on a terminal (issue 14, finding 10); and another user's job, whose record is redacted."""

from __future__ import annotations

import asyncio
import os
import pty
import sys

import pytest

from daemon.ctl import render
from protocol import Enqueue, Enqueued
from tests.support.paths import ROOT
from tests.support.pool import Pool
from tests.support.poolctl import poolctl

HOSTILE = "x\x1b]0;pwned\x07\x1b[2J[red]red[/]\u202etxt.exe"


def test_clean_shows_every_hostile_character_as_an_escape() -> None:
    assert render.clean(HOSTILE) == "x\\x1b]0;pwned\\x07\\x1b[2J[red]red[/]\\u202etxt.exe"
    assert render.clean("plain text: ok") == "plain text: ok"


async def hostile_job(pool: Pool) -> str:
    async with pool.client("bob") as bob:
        spec = {"argv": ["true", HOSTILE], "name": HOSTILE, "env": {"K": HOSTILE}}
        return (await bob.call(Enqueue(spec, None), Enqueued)).job_id


async def test_ls_and_show_piped_print_no_control_character(pool: Pool) -> None:
    job_id = await hostile_job(pool)
    for args in (("ls",), ("show", job_id)):
        code, out, _ = await poolctl(pool.env("alice"), *args)
        assert code == 0
        assert "\x1b" not in out
        assert "\u202e" not in out
        assert "\\x1b]0;pwned" in out


async def in_a_terminal(env: dict[str, str], *args: str) -> str:
    """poolctl ARGS with its stdout on a pseudo-terminal (rich draws its tables there)."""
    leader, follower = pty.openpty()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "daemon.ctl.cli", *args, stdout=follower, stderr=follower,
        env={**env, "PYTHONPATH": str(ROOT), "TERM": "xterm", "COLUMNS": "200"},
    )  # fmt: skip
    os.close(follower)
    chunks = []
    loop = asyncio.get_running_loop()
    while True:
        try:
            chunk = await asyncio.wait_for(loop.run_in_executor(None, os.read, leader, 65536), 30)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert await asyncio.wait_for(proc.wait(), 30) == 0
    return b"".join(chunks).decode()


@pytest.mark.parametrize("command", ["ls", "show"])
async def test_on_a_terminal_no_sequence_of_the_jobs_own_and_no_markup(pool: Pool, command: str) -> None:
    job_id = await hostile_job(pool)
    out = await in_a_terminal(pool.env("alice"), *(["ls"] if command == "ls" else ["show", job_id]))
    assert "\x1b]0;" not in out  # no title set, no screen cleared: only rich's own styling
    assert "\x1b[2J" not in out
    assert "\\x1b]0;pwned" in out
    assert "[red]red[/]" in out  # shown as written, not taken as markup


def test_another_users_job_with_hidden_data_is_shown(capsys: pytest.CaptureFixture[str]) -> None:
    record = {
        "id": "default.0mzk4g8x1a2b", "state": "queued", "cancel_requested": False, "worker": "",
        "spec": {"name": "", "user": "alice", "queue": "default", "argv": ["train"], "gpus": 0, "cwd": None,
                 "env": {"WANDB_API_KEY": "<hidden>"}, "timeout": None, "max_attempts": 3, "retries": 0,
                 "inputs": [{"dest": "data", "kind": "dir"}], "snapshot": {"commit": "abc"}},
        "attempt": 0, "enqueued_at": 0.0, "started_at": None, "ended_at": None, "exit_code": None,
        "detail": "", "attempts": [], "result": {},
    }  # fmt: skip
    render.job(record, as_json=False)
    out = capsys.readouterr().out
    assert "WANDB_API_KEY=<hidden>" in out
    assert "data (dir (hidden))" in out


ROWS = {  # what `ls` is asked to show: job specs
    "empty": [],
    "one": [{"argv": ["true"], "name": "train"}],
    "many": [{"argv": ["true"], "name": f"sweep-{i}"} for i in range(60)],
    "long": [{"argv": ["python", "train.py", *["--flag"] * 80], "name": "n" * 256}],  # the longest taken
    "hostile": [{"argv": ["true", HOSTILE], "name": HOSTILE}],
}


@pytest.mark.parametrize("case", list(ROWS))
async def test_ls_renders_every_shape_of_table_piped_and_on_a_terminal(pool: Pool, case: str) -> None:
    env = pool.env("alice")
    async with pool.client("alice") as c:
        ids = [(await c.call(Enqueue(spec, None), Enqueued)).job_id for spec in ROWS[case]]
    code, out, err = await poolctl(env, "ls")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split() == [c.upper() for c in render.JOB_COLUMNS[: render.SHOWN]]
    assert [line.split()[0] for line in lines[1:]] == ids  # a row a job, in order, nothing else
    assert "\x1b" not in out
    widths = {len(line) for line in lines}
    assert max(widths) < 600  # a long name is one cell, not the whole command line
    code, out, _ = await poolctl(env, "ls", "--no-header", "--format", "id")
    assert out.split() == ids

    drawn = await in_a_terminal(env, "ls")
    assert "ID" in drawn
    assert all(job_id in drawn for job_id in ids)  # never cut or wrapped away, however long the row
    assert "\x1b]0;" not in drawn
