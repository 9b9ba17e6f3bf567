"""What poolctl prints of fields other users wrote: never a control sequence, never rich markup,
piped or on a terminal (issue 14, finding 10); and another user's job, whose record is redacted."""

from __future__ import annotations

import asyncio
import os
import pty
import re
import shlex
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


WIDE = ["训练模型", "🚀 launch", "plain", "café"]  # two columns a character, emoji, ASCII, a 2-byte one


def starts(line: str, word: str) -> int:
    """The terminal column `word` starts at in `line` (a wide character takes two)."""
    from rich.cells import cell_len

    return cell_len(line[: line.index(word)])


async def test_wide_characters_keep_the_columns_aligned(pool: Pool) -> None:
    """Issue 47 item 9: a job named in CJK or with an emoji pushed the columns after it out of
    line when piped (padded by characters, not by the columns a terminal gives them). Each row's
    USER, QUEUE and STATE now start where their headers do: piped, in a live view, and on a
    terminal (rich draws it there)."""
    env = pool.env("alice")
    async with pool.client("alice") as c:
        for name in WIDE:
            await c.call(Enqueue({"argv": ["true"], "name": name}, None), Enqueued)
    code, listed, _ = await poolctl(env, "ls")
    assert code == 0
    code, watched, _ = await poolctl(env, "ls", "--watch", "0.5", "-n", "1", "--format", "name,user,state")
    assert code == 0
    drawn = re.sub(r"\x1b\[[0-9;]*m", "", await in_a_terminal(env, "ls"))  # rich's styles
    for out in (listed, watched, drawn):
        lines = [line for line in out.splitlines() if "USER" in line or "alice" in line]
        assert len(lines) == 1 + len(WIDE), out
        for header, cell in (("USER", "alice"), ("STATE", "queued")):
            assert {starts(line, header if line is lines[0] else cell) for line in lines} == {
                starts(lines[0], header)
            }, out


async def test_show_prints_the_command_as_a_shell_takes_it(pool: Pool) -> None:
    """Issue 47 item 9: `show` joined the command's words with spaces, so `python -c "print(1)"`
    read as `python -c print(1)` and a path with a space as two words. It prints the command
    quoted as a shell needs it: pasted back, it runs the same words."""
    argv = ["python", "-c", "print('hi there')", "a b", "$HOME", "plain"]
    _, out, _ = await poolctl(pool.env("alice"), "enqueue", "--", *argv)
    code, out, _ = await poolctl(pool.env("alice"), "show", out.strip())
    assert code == 0
    command = next(line for line in out.splitlines() if line.startswith("command:"))
    assert command.split(":", 1)[1].strip() == shlex.join(argv)
    assert shlex.split(command.split(":", 1)[1]) == argv
