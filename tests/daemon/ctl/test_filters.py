"""issue 47 items 5 and 8, poolctl run as a subprocess against a real pool: `ls --me/--user/--name`
and `cancel` by selection, as Slurm's squeue and scancel; an array's tasks told apart in `ls`, the
--format columns a researcher asks for, `wait` with a bar for an array and with nothing to wait for."""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import struct
import sys
import termios

import orjson
import pytest

from daemon.job import JobState, Outcome
from protocol import JobList, ListJobs
from protocol.codec import decode_message
from protocol.frames import FrameType, pack_payload
from tests.support.paths import ROOT
from tests.support.pool import Pool
from tests.support.poolctl import poolctl


async def _queued(env: dict[str, str], *args: str) -> str:
    code, out, err = await poolctl(env, "enqueue", *args)
    assert code == 0, err
    return out.strip()


async def on_terminal(env: dict[str, str], *args: str, typed: bytes = b"") -> tuple[int, str]:
    """`poolctl ARGS` with a terminal (a pty) for its stdin, stdout and stderr, `typed` typed on
    it: its exit code and all it wrote there."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "daemon.ctl.cli", *args,
        cwd="/", env={**env, "PYTHONPATH": str(ROOT), "TERM": "xterm"},
        stdin=follower, stdout=follower, stderr=follower,
    )  # fmt: skip
    os.close(follower)
    os.write(leader, typed)

    def read_all() -> bytes:
        out = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: every end of the terminal closed
                return out
            if not chunk:
                return out
            out += chunk

    try:
        out = await asyncio.wait_for(asyncio.to_thread(read_all), 60)
        code = await asyncio.wait_for(proc.wait(), 10)
    finally:
        os.close(leader)
    text = out.decode(errors="replace")
    assert "Traceback" not in text, text
    return code, text


async def test_ls_selects_by_user_and_name_on_the_server_before_its_limit(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 47 item 5: `ls --me`, `--user U` and `--name PATTERN` list only those jobs; the
    server selects them (a listing's limit counts the selected jobs, so one's own are found among
    many others', and no one else's are sent); a client older than the filters is still served,
    and a server older than them reads as unfiltered, which poolctl refuses to print as filtered."""
    alice, bob = pool.env("alice"), pool.env("bob")
    bobs = [await _queued(bob, "--name", f"sweep-b{i}", "--", "true") for i in range(3)]
    mine = await _queued(alice, "--name", "sweep-a", "--", "true")
    other = await _queued(alice, "--", "python", "train.py")

    code, out, err = await poolctl(alice, "ls", "--me", "--limit", "1", "--format", "id", "--no-header")
    assert (code, out.split()) == (0, [mine]), err
    code, out, _ = await poolctl(alice, "ls", "--user", "bob", "--format", "id,user", "--no-header")
    assert [line.split() for line in out.splitlines()] == [[b, "bob"] for b in bobs]
    code, out, _ = await poolctl(alice, "ls", "--name", "sweep-*", "--json")
    assert sorted(orjson.loads(line)["id"] for line in out.splitlines()) == sorted([*bobs, mine])
    code, out, _ = await poolctl(alice, "ls", "--me", "--name", "python *", "--format", "id", "--no-header")
    assert out.split() == [other]
    code, out, _ = await poolctl(alice, "ls", "--watch", "0.5", "-n", "1", "--user", "bob", "--format", "id")
    assert out.split()[:3] == ["3", "job(s)", "at"]
    assert out.split()[4:] == ["ID", *bobs]
    code, _, err = await poolctl(alice, "ls", "--me", "--user", "bob")
    assert code == 2
    assert "not allowed with argument" in err

    async with pool.client("alice") as client:  # the wire: the server filtered, and says so
        reply = await client.call(ListJobs(None, None, False, 100, "bob", None), JobList)
        assert ([j["id"] for j in reply.jobs], reply.filtered) == (bobs, True)
    older_request = {"op": "list_jobs", "queue": None, "state": None, "include_finished": False, "limit": 5}
    assert decode_message(FrameType.REQUEST, pack_payload(older_request)) == ListJobs(None, None, False, 5)
    older_reply = decode_message(FrameType.REPLY, pack_payload({"op": "job_list", "jobs": []}))
    assert older_reply == JobList([], filtered=False)

    monkeypatch.setattr(JobList, "__record_fields__", ("jobs",))  # the reply as an older server sends it
    code, out, err = await poolctl(alice, "ls", "--me")
    assert (code, out) == (1, "")
    assert err.startswith("poolctl: this pool's server is older than --me, --user and --name")


async def test_cancel_by_selection_asks_first_and_cancels_only_what_it_may(pool: Pool) -> None:
    """issue 47 item 5: `cancel --name/--state/--me/--user` cancels the jobs a selection picks:
    the caller's own unless --user names another's; asked first on a terminal, or with --yes;
    another user's jobs left alone where the pool's rules forbid it; how many it cancelled said."""
    alice, bob = pool.env("alice"), pool.env("bob")
    sweep = [await _queued(alice, "--name", f"sweep-{i}", "--", "true") for i in range(2)]
    keep = await _queued(alice, "--name", "keep", "--", "true")
    bobs = await _queued(bob, "--name", "sweep-b", "--", "true")

    code, _, err = await poolctl(alice, "cancel")
    assert (code, "give job ids, or select jobs with --me" in err) == (2, True)
    code, _, err = await poolctl(alice, "cancel", keep, "--me")
    assert (code, "not both" in err) == (2, True)
    code, _, err = await poolctl(alice, "cancel", "--state", "failed", "--yes")
    assert (code, "those jobs have ended" in err) == (2, True)
    code, _, err = await poolctl(alice, "cancel", "--name", "sweep-*")  # no terminal to ask on
    assert code == 2
    assert "your jobs named 'sweep-*': 2 job(s)" in err
    assert "add --yes" in err
    code, text = await on_terminal(alice, "cancel", "--name", "sweep-*", typed=b"n\n")
    assert code == 0
    assert "cancel these 2 job(s)? [y/N]" in text
    assert "nothing cancelled" in text
    assert (await pool.queue.get(sweep[0])).state is JobState.QUEUED

    code, out, err = await poolctl(alice, "cancel", "--name", "sweep-*", "--yes")
    assert code == 0, err
    assert sorted(out.split()) == sorted([*sweep, "cancelled", "cancelled"])
    assert "cancelled 2 of 2 job(s): your jobs named 'sweep-*'" in err
    assert (await pool.queue.get(bobs)).state is JobState.QUEUED  # bob's sweep-b: not alice's
    assert (await pool.queue.get(keep)).state is JobState.QUEUED

    code, out, err = await poolctl(alice, "cancel", "--user", "bob", "--yes")
    assert code == 6
    assert "cancelled 0 of 1 job(s): bob's jobs" in err
    assert "another user's" in err
    assert (await pool.queue.get(bobs)).state is JobState.QUEUED
    code, _, err = await poolctl(alice, "cancel", "--me", "--state", "queued", "--name", "none*", "--yes")
    assert (code, err.strip()) == (0, "poolctl: your queued jobs named 'none*': none: nothing to cancel")


async def test_an_arrays_tasks_are_told_apart_and_waited_for_with_a_bar(pool: Pool) -> None:
    """issue 47 item 8: `ls` shows an INDEX column for an array's tasks and a long command cut in
    its middle (a sweep's values are at its end); --format has index, gpus, priority, exit and
    reason; `wait ARRAY_ID` draws a bar on a terminal; `wait` with no ids has nothing to wait for."""
    alice = pool.env("alice")
    long = ["python", "train_a_rather_long_model_name.py", "--data", "/datasets/imagenet", "--lr", "{lr}"]
    array_id = await _queued(alice, "--array", "0-1", "--sweep", "lr=1e-3,3e-4", "--", *long)
    lease = await pool.queue.claim("stand-in", ["default"])
    assert lease is not None
    await pool.queue.complete(lease, Outcome(JobState.FAILED, exit_code=3, detail="exited with status 3"))

    code, out, _ = await poolctl(alice, "ls", "--all")
    header, *rows = [line.split() for line in out.splitlines()]
    assert header[:3] == ["ID", "INDEX", "NAME"]
    assert sorted(row[1] for row in rows) == ["0", "0", "1", "1"]
    assert out.count("python train_a_rath…s/imagenet --lr 3e-4 ") == 2  # the value told apart

    code, out, err = await poolctl(alice, "ls", "--all", "--format", "index,state,gpus,priority,exit,reason")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["INDEX", "STATE", "GPUS", "PRIORITY", "EXIT", "REASON"]
    assert lines[1].split() == ["0", "failed", "0", "0", "3", "exited", "with", "status", "3"]
    assert sorted(line.split()[0] for line in lines[2:]) == ["0", "1", "1"]
    assert all(line.split()[1:5] == ["queued", "0", "0", "-"] for line in lines[2:])
    assert all("no live worker serves queue 'default'" in line for line in lines[2:])  # as show says

    code, out, err = await poolctl(alice, "wait")
    assert (code, out, err) == (0, "", "poolctl: nothing to wait for\n")
    code, text = await on_terminal(alice, "wait", "--timeout", "0.5", array_id)
    assert code == 124
    assert "1/4" in text, text
