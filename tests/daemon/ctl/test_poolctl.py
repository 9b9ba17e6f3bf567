"""`poolctl` run as a researcher runs it (a subprocess) against a real server: output, exit codes,
and each error message. No tracebacks, ever."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import orjson
import pytest

from daemon.job import JobSpec, JobState, Outcome
from daemon.queue.embedded_redis import EmbeddedRedis, free_port
from daemon.server import handlers
from tests.support.git_repo import git, make_repo
from tests.support.pool import Pool, running_pool
from tests.support.poolctl import poolctl


async def test_enqueue_ls_show_cancel_wait(pool: Pool) -> None:
    env = pool.env("alice")
    code, out, _ = await poolctl(
        env,
        "enqueue",
        "--name",
        "train",
        "--gpus",
        "0",
        "--env",
        "LR=3e-4",
        "--",
        "python",
        "train.py",
        "--lr",
        "3e-4",
    )
    assert code == 0
    job_id = out.strip()
    assert job_id.startswith("default.")
    code, out, _ = await poolctl(env, "enqueue", "--json", "--key", "k1", "--", "echo", "hi")
    assert code == 0
    second = orjson.loads(out)["id"]

    code, out, _ = await poolctl(env, "ls")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "NAME", "USER", "QUEUE", "STATE", "ATTEMPT", "WORKER", "WAITED", "RAN"]
    assert lines[1].split()[:5] == [job_id, "train", "alice", "default", "queued"]
    assert lines[2].split()[0] == second

    code, out, _ = await poolctl(env, "ls", "--json")
    assert [orjson.loads(line)["id"] for line in out.splitlines()] == [job_id, second]

    code, out, _ = await poolctl(env, "show", job_id)
    assert code == 0
    assert "command:   python train.py --lr 3e-4" in out
    assert "env:       LR=3e-4" in out
    assert "pending:" in out

    code, out, _ = await poolctl(env, "cancel", second)
    assert (code, out.split()) == (0, [second, "cancelled"])
    code, out, _ = await poolctl(env, "wait", second)
    assert code == 1  # cancelled is not success
    assert out.split() == [second, "cancelled"]
    code, out, err = await poolctl(env, "wait", "--timeout", "0.2", job_id)
    assert code == 124
    assert "timed out" in err


async def test_a_priority_job_is_listed_and_shown_as_next_to_start(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """`--priority` through poolctl: refused above the user's ceiling, and below it `ls` lists jobs
    in the order they will start, and `show` says why."""
    async with running_pool(redis_server, tmp_path, max_priority={"bob": 10}) as pool:
        code, _, err = await poolctl(pool.env("alice"), "enqueue", "--priority", "7", "--", "true")
        assert code != 0
        assert "priority 7 is above your ceiling of 0: leave --priority out, or ask" in err
        env = pool.env("bob")
        code, first, _ = await poolctl(env, "enqueue", "--", "true")
        assert code == 0
        code, urgent, err = await poolctl(env, "enqueue", "--priority", "7", "--", "true")
        assert code == 0, err
        code, out, _ = await poolctl(env, "ls", "--format", "id")
        assert out.split()[1:] == [urgent.strip(), first.strip()]
        code, out, _ = await poolctl(env, "show", urgent.strip())
        assert "priority:  7" in out
        assert "next to start (priority 7: before the queue's jobs of lower priority)" in out
        code, out, _ = await poolctl(env, "show", first.strip())
        assert "1 job(s) ahead of it" in out


async def test_logs_follow_prints_live_output_and_exits_with_the_job_code(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`logs -f` ends as soon as the job has ended and its last lines are printed, and at once for
    a job that ended before (issue 47 item 6: each waited out a blocking read of the log first,
    here made as long as a read may block, so that its wait cannot hide in a process's start)."""
    monkeypatch.setattr(handlers, "LOG_BLOCK_SECONDS", 2.5)
    env = pool.env("bob")
    _, out, _ = await poolctl(env, "enqueue", "--", "python", "-c", "print('hi')")
    job_id = out.strip()
    lease = await pool.queue.claim("stand-in", ["default"])
    assert lease is not None
    await pool.queue.append_log(lease, 1, [b"hi\n"])
    follower = asyncio.create_task(poolctl(env, "logs", "-f", job_id))
    await asyncio.sleep(0.5)
    assert not follower.done()
    await pool.queue.append_log(lease, 2, [b"bye\n"])
    await pool.queue.complete(lease, Outcome(JobState.FAILED, exit_code=7))
    ended = time.monotonic()
    code, out, _ = await follower
    assert (code, out) == (7, "hi\nbye\n")
    assert time.monotonic() - ended < 1.5  # not a read's 2.5 s later
    code, out, _ = await poolctl(env, "logs", job_id)
    assert (code, out) == (0, "hi\nbye\n")
    started = time.monotonic()
    code, out, _ = await poolctl(env, "logs", "-f", job_id)
    assert (code, out) == (7, "hi\nbye\n")
    assert time.monotonic() - started < 2.5  # a process's start, not that and a read's 2.5 s


async def test_enqueue_follow_prints_the_jobs_output_and_exits_with_its_code(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`enqueue -f`: submit and follow in one command, as Ray's job submit does; it ends as soon
    as the job has (issue 47 item 6: it waited out a blocking read of the log first)."""
    monkeypatch.setattr(handlers, "LOG_BLOCK_SECONDS", 2.5)
    env = pool.env("bob")
    follower = asyncio.create_task(poolctl(env, "enqueue", "-f", "--", "sh", "-c", "echo hi; exit 5"))
    lease = None
    for _ in range(200):  # a bound, not a speed assertion
        if (lease := await pool.queue.claim("stand-in", ["default"])) is not None:
            break
        await asyncio.sleep(0.05)
    assert lease is not None
    await pool.queue.append_log(lease, 1, [b"hi\n"])
    await asyncio.sleep(0.3)
    assert not follower.done()  # following: the job has not ended
    await pool.queue.complete(lease, Outcome(JobState.FAILED, exit_code=5))
    ended = time.monotonic()
    code, out, err = await follower
    assert (code, out) == (5, "hi\n")
    assert time.monotonic() - ended < 1.5  # not a read's 2.5 s later
    assert (
        err.strip()
        == f"poolctl: {lease.job_id} queued; following its output (Ctrl-C stops following, not the job)"
    )
    code, _, err = await poolctl(env, "enqueue", "-f", "--from-file", "/dev/null")
    assert (code, err.strip()) == (2, "poolctl: --follow goes with one job, not --from-file")


async def test_error_messages(pool: Pool, tmp_path: Path) -> None:
    env = pool.env("alice")
    code, _, err = await poolctl(env, "show", "default.nosuchjob123")
    assert code == 5
    assert (
        err.strip()
        == "poolctl: no job 'default.nosuchjob123' in this pool (finished jobs are kept for a limited time)"
    )
    code, _, err = await poolctl(env, "show", "garbage")
    assert code == 2
    assert "is not a job id" in err
    code, _, err = await poolctl(env, "enqueue")
    assert code == 2
    assert "nothing to run" in err
    code, _, err = await poolctl(env, "enqueue", "--env", "NOEQUALS", "--", "true")
    assert (code, "expected NAME=VALUE" in err) == (2, True)
    code, _, err = await poolctl(env, "enqueue", "--gpus", "-1", "--", "true")
    assert (code, "gpus" in err) == (2, True)

    code, _, err = await poolctl({**env, "GPUPOOL_TOKEN": "wrong-token-wrong-token"}, "ls")
    assert code == 4
    assert "refused user 'alice'" in err
    assert "GPUPOOL_TOKEN" in err

    nowhere = f"127.0.0.1:{free_port()}"
    code, _, err = await poolctl({**env, "GPUPOOL_SERVER": nowhere}, "ls")
    assert code == 3
    assert f"cannot reach the pool server at {nowhere}" in err
    assert "make run" in err
    code, _, err = await poolctl(env, "--server", "nonsense", "ls")
    assert (code, "not a server address" in err) == (2, True)


async def test_an_input_path_that_is_not_there_is_said_to_be_missing(pool: Pool, tmp_path: Path) -> None:
    """A dataset name has no '/' and does not start with '.': such an --input is a path, and one
    that is not there is a missing file, not a bad dataset name."""
    env = pool.env("alice")
    for missing in ("/nonexistent", "./nothere.txt", "data/train.bin:train.bin", "~/x"):
        code, _, err = await poolctl(env, "enqueue", "--input", missing, "--", "true")
        path = missing.rpartition(":")[0] or missing
        assert (code, err.strip()) == (2, f"poolctl: --input {path}: no such file or directory"), missing


# Each user mistake: the command, the exit code, and what the one sentence must say.
BAD_INPUTS = [
    (("show", "default.zzzzzzzzzzzz"), 5, "no job 'default.zzzzzzzzzzzz' in this pool"),
    (("show", "garbage"), 2, "is not a job id"),
    (("logs", "default.zzzzzzzzzzzz"), 5, "no job"),
    (("wait", "default.zzzzzzzzzzzz"), 5, "no job"),
    (("get", "default.zzzzzzzzzzzz"), 5, "no job"),
    (("cancel", "default.zzzzzzzzzzzz"), 5, "no job"),
    (("ls", "--state", "bogus"), 2, "unknown state 'bogus'"),
    (("ls", "--queue", "nosuch"), 2, "no queue 'nosuch' in this pool"),
    (("ls", "--watch", "1", "--queue", "nosuch"), 2, "no queue 'nosuch' in this pool"),
    (("--pool", "nope", "ls"), 2, "no pool 'nope' (--pool)"),
    (("put", "{tmp}/missing"), 2, "{tmp}/missing: no such file or directory"),
    (
        ("enqueue", "--from-file", "{tmp}/missing.jsonl"),
        2,
        "cannot read jobs from {tmp}/missing.jsonl: No such file",
    ),
    (("enqueue", "--queue", "bad queue!", "--", "true"), 2, "is not a queue name"),
    (("enqueue", "--timeout", "-5", "--", "true"), 2, "positive number of seconds"),
    # {job} has ended (cancelled); {tmp}/a-file is a file
    (("get", "{job}", "{tmp}/a-file"), 2, "DEST {tmp}/a-file is not a directory"),
    (("get", "{job}", "{tmp}/a-file/sub"), 2, "DEST {tmp}/a-file/sub cannot be created (Not a directory)"),
    # issue 47 item 9: a bad --from-file line is named FILE:LINE (the files: test_a_bad_input_...)
    (("enqueue", "--from-file", "{tmp}/not-json.jsonl"), 2, "{tmp}/not-json.jsonl:3: not JSON ("),
    (("enqueue", "--from-file", "{tmp}/array.jsonl"), 2, "{tmp}/array.jsonl:2: a JSON array, not an object"),
    (("enqueue", "--from-file", "{tmp}/no-gpus.jsonl"), 2, "{tmp}/no-gpus.jsonl:2: job gpus: must be an"),
    (("enqueue", "--from-file", "{tmp}/huge.jsonl"), 2, "{tmp}/huge.jsonl:2: a job spec of 20.0 MiB, more"),
    # issue 47 item 9: a mistake argparse finds is its one line and where the usage is, no usage
    (("ls", "--limit", "many"), 2, "--limit: expected a whole number from 1 to 10000, not 'many' (see "),
    (("enqueue", "--gpus", "two", "--", "true"), 2, "--gpus: expected a whole number from 0 to 1024"),
    (("ls", "--bogus"), 2, "unrecognized arguments: --bogus (see poolctl ls --help)"),
    (("--pool", "p", "ls", "x"), 2, "unrecognized arguments: x (see poolctl ls --help)"),
    (("show",), 2, "the following arguments are required: job (see poolctl show --help)"),
    ((), 2, "the following arguments are required: COMMAND (see poolctl --help)"),
    (("completion", "tcsh"), 2, "invalid choice: 'tcsh'"),
    # issue 47 item 9: every number of every command in its range (daemon/ctl/parsing.py)
    (("ls", "--limit", "-1"), 2, "--limit: expected a whole number from 1 to 10000, not '-1'"),
    (("ls", "--limit", "0"), 2, "--limit: expected a whole number from 1 to 10000, not '0'"),
    (("ls", "--watch", "0"), 2, "--watch/-w: expected a positive number of seconds, not '0'"),
    (("ls", "--watch", "1", "-n", "-1"), 2, "-n/--views: expected a whole number from 0 to 1000000"),
    (("ls", "--watch", "1", "-n", "9" * 20), 2, "-n/--views: expected a whole number from 0 to 1000000"),
    (("wait", "--timeout", "-5", "default.zzzzzzzzzzzz"), 2, "--timeout: expected a number of seconds of"),
    (("wait", "--timeout", "nan", "default.zzzzzzzzzzzz"), 2, "at least 0, not 'nan'"),
    (("top", "-d", "inf"), 2, "-d/--delay: expected a positive number of seconds, not 'inf'"),
    (("top", "-n", "-2"), 2, "-n/--views: expected a whole number from 0 to 1000000, not '-2'"),
    (("enqueue", "--gpus", "1025", "--", "true"), 2, "--gpus: expected a whole number from 0 to 1024"),
    (("enqueue", "--priority", "101", "--", "true"), 2, "--priority: expected a whole number from 0 to 100"),
    (("enqueue", "--retries", "-1", "--", "true"), 2, "--retries: expected a whole number from 0 to 100"),
    (("enqueue", "--max-attempts", "0", "--", "true"), 2, "--max-attempts: expected a whole number from 1"),
    (("enqueue", "--stop-grace", "3601", "--", "true"), 2, "positive number of seconds up to 3600"),
    (("enqueue", "--checkpoint-every", "0", "--", "true"), 2, "--checkpoint-every: expected a positive"),
    (("pilot", "slurm", "--config", "c", "--walltime", "1:00:00", "--count", "0"), 2, "--count: expected"),
    (
        ("pilot", "pbs", "--config", "c", "--walltime", "1:00:00", "--gpus-per-node", "-1"),
        2,
        "from 0 to 1024",
    ),
    (("pilot", "pbs", "--config", "c", "--walltime", "1:00:00", "--max-lifetime", "0"), 2, "a positive"),
    (("pilot", "pbs", "--config", "c", "--walltime", "1:00:00", "--idle-exit", "-1"), 2, "--idle-exit: "),
]


async def test_a_bad_input_gets_one_sentence_and_its_exit_code(pool: Pool, tmp_path: Path) -> None:
    """Each of BAD_INPUTS is refused in one line that says what was wrong, with its exit code.
    issue 47 item 3: `get` into a DEST that is a file or cannot be made printed a traceback.
    issue 47 item 9: argparse's mistakes without the usage, every numeric option range-checked,
    and a --from-file line that is no job spec, or 20 MB, named FILE:LINE (not "unreachable")."""
    env = pool.env("alice")
    job = (await pool.queue.enqueue(JobSpec(argv=("true",), user="alice")))[0]
    await pool.queue.cancel(job)
    (tmp_path / "a-file").write_text("mine\n")
    one = b'{"argv": ["true"]}\n'  # a good line, before the bad one
    (tmp_path / "not-json.jsonl").write_bytes(one + b"\n" + b'{"argv": [tru\n')
    (tmp_path / "array.jsonl").write_bytes(one + b'["true"]\n')
    (tmp_path / "no-gpus.jsonl").write_bytes(one + b'{"argv": ["true"], "gpus": -1}\n')
    (tmp_path / "huge.jsonl").write_bytes(one + b'{"argv": ["%s"]}\n' % (b"x" * (20 * 2**20 - 14)))
    cases = [tuple(a.format(tmp=tmp_path, job=job) for a in template) for template, _, _ in BAD_INPUTS]
    side_by_side = asyncio.Semaphore(4)  # each is a fresh interpreter: their startups overlap

    async def run(args: tuple[str, ...]) -> tuple[int, str, str]:
        async with side_by_side:
            return await poolctl(env, *args)

    answers = await asyncio.gather(*(run(args) for args in cases))
    for args, (_, code, says), (got, out, err) in zip(cases, BAD_INPUTS, answers, strict=True):
        assert (got, out) == (code, ""), (args, err)
        assert err.startswith("poolctl: "), (args, err)
        assert err.count("\n") == 1, (args, err)  # one sentence, one line: never a traceback
        assert says.format(tmp=tmp_path) in err, (args, err)
    assert (tmp_path / "a-file").read_text() == "mine\n"


async def test_a_batch_too_large_for_one_message_says_its_size_and_the_limit(
    pool: Pool, tmp_path: Path
) -> None:
    """issue 47 item 9: a request larger than the server takes in one message read "the server
    at ... is closing this connection" (exit 3, as if the pool were down); it is a usage error,
    exit 2, saying the request's size and the server's limit, and nothing is queued."""
    env = pool.env("alice")
    job = orjson.dumps({"argv": ["true"], "env": {"X": "x" * 60_000}}) + b"\n"  # each a spec it takes
    (tmp_path / "many.jsonl").write_bytes(job * 300)
    code, out, err = await poolctl(env, "enqueue", "--from-file", str(tmp_path / "many.jsonl"))
    assert (code, out) == (2, "")
    assert err == (
        "poolctl: the request is 17.2 MiB, more than the 16.0 MiB the server takes in one message "
        "(max_frame_size in its config): send less at once\n"
    )
    assert await pool.queue.list_jobs(None, include_finished=True, limit=10) == []


async def test_git_at_a_commit_origin_lacks_is_refused_saying_how_to_push_it(
    pool: Pool, tmp_path: Path
) -> None:
    """issue 47 item 9: `--git` at a commit origin lacks warned, then queued a job that had to fail
    (no worker can fetch that commit). It is refused, exit 2, as `--gpus` with no such worker is,
    saying how to push it or what to pass instead, and nothing is queued; once pushed, it is."""
    env = pool.env("alice")
    repo, origin = tmp_path / "repo", tmp_path / "origin.git"
    make_repo(repo)
    git(tmp_path, "clone", "--quiet", "--bare", str(repo), str(origin))
    git(repo, "remote", "add", "origin", str(origin))
    git(repo, "fetch", "--quiet", "origin")
    (repo / "version.txt").write_text("three\n")
    git(repo, "commit", "--quiet", "-am", "three")  # on no branch of origin yet
    head = git(repo, "rev-parse", "HEAD")
    code, out, err = await poolctl(env, "enqueue", "--git", "--", "true", cwd=repo)
    assert (code, out) == (2, "")
    assert err == (
        f"poolctl: --git: commit {head[:12]} is on no branch of origin, so no worker can fetch it; "
        "the job was not queued: push it first (git push), pass --ref with a commit origin has, "
        "or leave --git out to send the working tree with the job\n"
    )
    assert await pool.queue.list_jobs(None, include_finished=True, limit=10) == []
    git(repo, "push", "--quiet", "origin", "main")
    code, out, err = await poolctl(env, "enqueue", "--git", "--", "true", cwd=repo)
    assert code == 0, err
    assert (await pool.queue.list_jobs(None, limit=10))[0].spec.git == {"repo": str(origin), "commit": head}


async def test_a_token_file_others_can_read_is_refused_saying_how_to_mend_it(pool: Pool) -> None:
    """The token is a password: like ssh with a private key, poolctl will not use one that
    others on the machine can read."""
    env = {k: v for k, v in pool.env("alice").items() if k != "GPUPOOL_TOKEN"}
    token = Path(env["XDG_CONFIG_HOME"]) / "gpupool" / "token"
    token.parent.mkdir(parents=True, exist_ok=True)
    token.write_text(pool.tokens["alice"] + "\n")
    token.chmod(0o644)
    code, _, err = await poolctl(env, "ls")
    assert code == 4
    assert err.strip() == f"poolctl: {token} is readable by others (mode 644): chmod 600 {token}"
    token.chmod(0o600)
    assert (await poolctl(env, "ls"))[0] == 0


async def test_workers_with_none_registered_and_health(pool: Pool) -> None:
    code, out, _ = await poolctl(pool.env(), "workers")
    assert code == 0
    assert "no workers" in out
    code, out, _ = await poolctl(pool.env(), "health")
    assert (code, out.startswith("ok: server")) == (0, True)
    code, _, _ = await poolctl({**pool.env(), "GPUPOOL_SERVER": f"127.0.0.1:{free_port()}"}, "health")
    assert code == 3


def test_non_loopback_listener_without_tokens_refuses_to_start(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    import subprocess

    env = dict(
        os.environ, XDG_CONFIG_HOME=str(tmp_path), GPUPOOL_MAIN_SERVER_REDIS_PASSWORD=redis_server.password
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "daemon.main",
            "--worker-mode",
            "multinode",
            "--redis-port",
            str(redis_server.port),
            "--metrics-listen",
            "127.0.0.1:0",
            "--listen",
            "0.0.0.0:0",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1
    assert "refusing to listen on 0.0.0.0:0 without authentication" in out.stderr
    assert "Traceback" not in out.stderr


async def test_workers_shows_a_live_worker_and_its_busy_slot(pool: Pool, tmp_path: Path) -> None:
    from tests.support.workers import running_worker, sh, wait_file

    await pool.queue.enqueue(sh("echo started > started; sleep 30", cwd=str(tmp_path)))
    async with running_worker(pool.queue, tmp_path / "w", slots=2) as worker:
        await wait_file(tmp_path / "started")
        for _ in range(50):  # the busy slot shows from the worker's next heartbeat on
            code, out, _ = await poolctl(pool.env(), "workers")
            if " 1/2 " in out:
                break
        assert code == 0
        header, row = out.splitlines()
        assert header.split() == [
            "WORKER",
            "HOST",
            "STATE",
            "SLOTS",
            "GPUS",
            "QUARANTINED",
            "HEARTBEAT",
            "VERSION",
        ]
        assert row.split()[:4] == [worker.id, worker.id.rsplit("-", 2)[0], "healthy", "1/2"]
        assert "cpu only" in row
        code, out, _ = await poolctl(pool.env(), "workers", "--json")
        assert orjson.loads(out)["id"] == worker.id
        code, out, _ = await poolctl(pool.env(), "health")
        assert "1 healthy worker" in out


async def test_another_users_job_is_shown_without_secrets_and_cannot_be_cancelled(pool: Pool) -> None:
    code, job_id, _ = await poolctl(
        pool.env("alice"), "enqueue", "--env", "HF_TOKEN=hf_secret", "--", "sleep", "9"
    )
    job_id = job_id.strip()
    code, out, err = await poolctl(pool.env("bob"), "cancel", job_id)
    assert code == 6
    assert "another user's: only its owner or a pool admin may cancel it" in err
    code, out, _ = await poolctl(pool.env("bob"), "show", job_id, "--json")
    assert code == 0
    assert orjson.loads(out)["spec"]["env"] == {"HF_TOKEN": "<hidden>"}
    code, out, err = await poolctl(pool.env("bob"), "logs", job_id)
    assert (code, "belongs to alice" in err) == (6, True)
    code, out, _ = await poolctl(pool.env("alice"), "cancel", job_id)
    assert (code, out.split()) == (0, [job_id, "cancelled"])


async def test_get_of_another_users_job_says_it_is_theirs(pool: Pool) -> None:
    """Issue 47 item 9: `get` of another user's job said "has not finished" while it ran, and
    "has no artifacts" once it ended (the server keeps its result from others). The server marks
    the record it withholds from a user, and `get` says the job is another user's (exit 6), as the
    download itself would be refused; its owner is still told it has not finished."""
    env = pool.env("alice")
    running = (await poolctl(env, "enqueue", "--", "sleep", "9"))[1].strip()
    ended = (await poolctl(env, "enqueue", "--", "true"))[1].strip()
    assert (await poolctl(env, "cancel", ended))[0] == 0
    for job_id in (running, ended):
        code, out, err = await poolctl(pool.env("bob"), "get", job_id)
        assert (code, out) == (6, ""), err
        only = "only its owner or a pool admin may download the artifacts of it"
        assert err.strip() == f"poolctl: job {job_id} belongs to alice: {only}"
    code, _, err = await poolctl(env, "get", running)
    assert (code, err.strip()) == (1, f"poolctl: job {running} has not finished (queued): no artifacts yet")


async def test_requeue_says_what_it_did_with_each_job(pool: Pool) -> None:
    code, job_id, _ = await poolctl(pool.env("alice"), "enqueue", "--", "true")
    assert code == 0
    job_id = job_id.strip()
    code, out, _ = await poolctl(pool.env("alice"), "requeue", job_id)
    assert (code, out.split()) == (0, [job_id, "queued"])  # not started: nothing to stop
    lease = await pool.queue.claim("w1", ["default"])  # as a worker would
    assert lease is not None
    code, out, err = await poolctl(pool.env("bob"), "requeue", job_id, "default.doesnotexist1")
    assert code != 0
    assert "is another user's: only its owner or a pool admin may requeue it" in err
    assert "no job 'default.doesnotexist1'" in err
    code, out, _ = await poolctl(pool.env("alice"), "requeue", "--json", job_id)
    assert (code, orjson.loads(out)) == (0, {"id": job_id, "state": "requeueing"})


async def test_requeue_of_a_job_that_ended_says_so_and_fails(pool: Pool) -> None:
    """issue 43 item 8: `requeue` of a finished job exited 0 as if it had worked."""
    code, job_id, _ = await poolctl(pool.env("alice"), "enqueue", "--", "true")
    job_id = job_id.strip()
    lease = await pool.queue.claim("w1", ["default"])  # as a worker would
    assert lease is not None
    await pool.queue.complete(lease, Outcome(JobState.SUCCEEDED, exit_code=0))
    code, out, err = await poolctl(pool.env("alice"), "requeue", job_id)
    assert code == 1
    assert out.split() == [job_id, "succeeded"]
    assert f"job {job_id} has ended (succeeded): requeue puts back only a running job" in err


async def test_a_queue_no_worker_serves_is_refused_naming_those_served(pool: Pool, tmp_path: Path) -> None:
    """Issue 47 item 4: `--queue nosuchqueue` was queued and waited forever. Once a worker has
    joined, a queue none serves is refused, naming the queues served, as a --gpus job no worker
    could hold is; --wait-for-worker queues it all the same."""
    from tests.support.workers import running_worker

    env = pool.env("alice")
    async with running_worker(pool.queue, tmp_path / "w", queues=["default", "gpu"], slots=1):
        code, out, err = await poolctl(env, "enqueue", "--queue", "nosuchqueue", "--", "true")
        assert (code, out) == (2, "")
        assert err == (
            "poolctl: no worker of this pool serves queue 'nosuchqueue' (its workers serve: default, "
            "gpu). Enqueue it with --wait-for-worker to keep it queued until such a worker joins\n"
        )
        code, out, _ = await poolctl(
            env, "enqueue", "--queue", "nosuchqueue", "--wait-for-worker", "--", "true"
        )
        assert (code, out.startswith("nosuchqueue.")) == (0, True)
