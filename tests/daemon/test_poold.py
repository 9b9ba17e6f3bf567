"""`poold` run as a user runs it (`make run`): it starts the embedded Redis, says where, and leaves
no redis-server behind when stopped."""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from daemon.queue.embedded_redis import _is_redis_process
from daemon.worker.identity import DEFAULT_UIDS
from tests.support import uids
from tests.support.workers import JOBS_AS_ROOT

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="what a root poold does with its jobs")


def start_poold(data_dir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "daemon.main",
            "--data-dir",
            str(data_dir),
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        stderr=subprocess.PIPE,
        text=True,
        # Its local slots' jobs: the tests' own, as before. It registers itself as a pool of this
        # machine's user (pools.toml, a token): in the test's directory, not in root's own ~/.config.
        env={**os.environ, "XDG_CONFIG_HOME": str(data_dir / "xdg"), **JOBS_AS_ROOT},
    )


def wait_ready(proc: subprocess.Popen[str]) -> str:
    """What poold logged until it said it was ready."""
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "server ready on" in line:
            return "".join(lines)
    raise AssertionError("poold exited before it was ready:\n" + "".join(lines))


def redis_pid(data_dir: Path) -> int:
    pid = json.loads((data_dir / "redis" / "server.json").read_text())["pid"]
    assert isinstance(pid, int)
    return pid


def test_ctrl_c_stops_cleanly_leaving_no_redis(tmp_path: Path) -> None:
    with start_poold(tmp_path) as proc:
        line = wait_ready(proc)
        assert "Redis on 127.0.0.1:" in line
        pid = redis_pid(tmp_path)
        assert _is_redis_process(pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    assert not _is_redis_process(pid)


def test_after_a_crash_the_next_poold_adopts_the_left_redis(tmp_path: Path) -> None:
    with start_poold(tmp_path) as proc:
        wait_ready(proc)
        pid = redis_pid(tmp_path)
        proc.kill()  # SIGKILL: poold cannot stop its redis-server
        proc.wait(10)
    assert _is_redis_process(pid)
    with start_poold(tmp_path) as again:
        try:
            wait_ready(again)
            assert redis_pid(tmp_path) == pid  # adopted, not a second server
        finally:
            again.send_signal(signal.SIGTERM)
            assert again.wait(30) == 0
    deadline = time.monotonic() + 10
    while _is_redis_process(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _is_redis_process(pid)
    assert os.path.exists(tmp_path / "redis" / "appendonly.aof")


def test_a_second_poold_on_the_same_data_dir_refuses_and_leaves_the_first_alone(tmp_path: Path) -> None:
    with start_poold(tmp_path) as first:
        try:
            wait_ready(first)
            pid = redis_pid(tmp_path)
            env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "xdg2"), **JOBS_AS_ROOT)
            second = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "daemon.main",
                    "--data-dir",
                    str(tmp_path),
                    "--listen",
                    "127.0.0.1:0",
                    "--metrics-listen",
                    "127.0.0.1:0",
                ],
                capture_output=True,
                text=True,
                env=env,
                timeout=60,
                check=False,
            )
            assert second.returncode == 1
            assert f"a pool already runs on {tmp_path}" in second.stderr
            assert "Traceback" not in second.stderr
            # issue 47 item 9: its undone start said "stopped" twice (once undone, once again
            # by main's stop): now once, before the reason it refused.
            assert second.stderr.count("gpupool server stopped") == 1, second.stderr
            assert _is_redis_process(pid)  # the first pool's Redis was not touched
            assert redis_pid(tmp_path) == pid
        finally:
            first.send_signal(signal.SIGTERM)
            assert first.wait(30) == 0


def test_the_embedded_pool_runs_jobs_on_its_own_slots(tmp_path: Path) -> None:
    """`make run`, then `poolctl enqueue` and `poolctl wait`: the job runs on the server's local slots
    (the Worker main.py hands the server), with no worker started separately. Stopped with a client
    still connected, it logs no traceback (issue 47 item 9: asyncio logged the cancelled session of
    each connection left)."""
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg"), **JOBS_AS_ROOT}
    argv = [sys.executable, "-m", "daemon.main", "--data-dir", str(tmp_path / "data")]
    argv += ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"]
    with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            said = wait_ready(proc)
            if JOBS_AS_ROOT:  # the explicit choice, said at every start
                assert 'runs its jobs as root (job_uid_range = "root")' in said, said

            def poolctl(*args: str) -> subprocess.CompletedProcess[str]:
                cmd = [sys.executable, "-m", "daemon.ctl.cli", *args]  # in no project, unlike this checkout
                return subprocess.run(
                    cmd, env=env, capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path
                )

            enqueued = poolctl("enqueue", "--", "sh", "-c", "echo ran-on-local-slots")
            assert enqueued.returncode == 0, enqueued.stderr
            job_id = enqueued.stdout.split()[0]
            waited = poolctl("wait", job_id)
            assert waited.returncode == 0, waited.stdout + waited.stderr
            logs = poolctl("logs", job_id)
            assert "ran-on-local-slots" in logs.stdout
            host, port = said.split("server ready on ")[1].split()[0].rsplit(":", 1)
            connected = socket.create_connection((host, int(port)), timeout=10)
        finally:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(30) == 0
        assert proc.stderr is not None
        stopping = proc.stderr.read()
    connected.close()
    assert "Traceback" not in stopping, stopping


Poolctl = Callable[..., subprocess.CompletedProcess[str]]


@contextmanager
def root_pool(*flags: str) -> Iterator[tuple[Path, Poolctl, str]]:
    """A pool as `make run` run by root starts it, with no job_uid_range unless `flags` give one,
    on a data directory that does not exist yet (`DIR/fresh/data`): yields DIR, a poolctl of this pool
    (run in DIR), and what poold logged until it was ready. In /tmp: pytest's directories are
    root's, 0700, as root's home is."""
    top = Path(tempfile.mkdtemp(prefix="gpupool-root-pool-"))
    top.chmod(0o711)
    env = {"PATH": os.environ["PATH"], "HOME": str(top), "XDG_CONFIG_HOME": str(top / "xdg")}
    argv = [sys.executable, "-m", "daemon.main", "--data-dir", str(top / "fresh" / "data")]
    argv += ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--web-listen", "off", *flags]

    def poolctl(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "daemon.ctl.cli", *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=False, cwd=top)

    try:
        with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env) as proc:
            try:
                said = wait_ready(proc)
                yield top, poolctl, said
            finally:
                proc.send_signal(signal.SIGINT)
                assert proc.wait(30) == 0
    finally:
        shutil.rmtree(top, ignore_errors=True)


def run_a_job(top: Path, poolctl: Poolctl) -> tuple[int, str]:
    """A job that says its uid and writes an output: its uid, and its output as poolctl got it."""
    enqueued = poolctl("enqueue", "--", "sh", "-c", 'id -u; echo written > "$GPUPOOL_OUTPUT/out.txt"')
    assert enqueued.returncode == 0, enqueued.stderr
    job_id = enqueued.stdout.split()[0]
    waited = poolctl("wait", job_id)
    logs = poolctl("logs", job_id).stdout
    assert waited.returncode == 0, waited.stdout + waited.stderr + logs
    fetched = poolctl("get", job_id, "got")
    assert fetched.returncode == 0, fetched.stderr
    [uid] = [line for line in logs.splitlines() if line.isdigit()]
    return int(uid), (top / "got" / "out.txt").read_text()


@root_only
def test_make_run_as_root_runs_jobs_as_leased_slot_uids_not_root() -> None:
    """issue 44 item 8: a root `poold` with no job_uid_range (`make run` as root) ran every
    user's job as root. Now it leases a uid of no one's for each of its slots, its jobs run
    as one of them, and they still run a command and write their output."""
    with root_pool() as (top, poolctl, said):
        assert [stat.S_IMODE((top / d).stat().st_mode) for d in ("fresh", "fresh/data")] == [0o711, 0o711]
        assert "leased for this poold alone" in said, said
        uid, output = run_a_job(top, poolctl)
    assert uid in DEFAULT_UIDS
    assert output == "written\n"


@root_only
def test_a_fresh_root_pool_with_fewer_uids_than_slots_starts_and_says_so() -> None:
    """issue 44 item 8: a fresh root `poold --job-uid-range 61100-61103` (here four uids of this
    test process's) refused to start on the data directory it had just made itself (0700: "the
    jobs' uids cannot pass through"), and the 32 slots of a single-machine pool wanted 32 uids.
    It makes that directory 0711 now, and runs as many slots as it has uids, saying so."""
    first = uids.uid(50)
    with root_pool("--job-uid-range", f"{first}-{first + 3}", "--worker-local-processors", "32") as (
        top,
        poolctl,
        said,
    ):
        assert "holds 4 uids for 32 slots: running 4 slots (give it 32 uids to run them all)" in said, said
        uid, output = run_a_job(top, poolctl)
    assert uid in range(first, first + 4)
    assert output == "written\n"


def read_until(master: int, said: list[str], wanted: str, seconds: float = 30) -> str:
    """What the terminal `master` showed, until it showed `wanted` (appended to `said`)."""
    deadline = time.monotonic() + seconds
    while wanted not in "".join(said):
        left = deadline - time.monotonic()
        readable = left > 0 and select.select([master], [], [], left)[0]
        assert readable, f"no {wanted!r} in time:\n" + "".join(said)
        try:
            said.append(os.read(master, 65536).decode(errors="replace"))
        except OSError:  # EIO: nothing has the terminal open any more
            raise AssertionError(f"poold left its terminal before {wanted!r}:\n" + "".join(said)) from None
    return "".join(said)


def test_sighup_reloads_and_poold_outlives_its_terminal(tmp_path: Path) -> None:
    """issue 47 item 2: SIGHUP (a closed terminal, a dropped ssh session) killed poold at once,
    and its running jobs with it. poold is started here as from a terminal (a pty, its controlling
    terminal, on its stdin, stdout and stderr). A job runs; a configuration that does not load
    is refused by SIGHUP, which changes nothing; then a user is added to the tokens file, and the
    log level, the bound on job names and a connection limit changed in the configuration file:
    SIGHUP reloads the first three and says so, and that the limit waits for a restart; the new
    user is let in where they were refused, and a name the new bound does not allow is refused.
    Then the terminal is closed (the kernel hangs poold up, and its log lines fail with EIO).
    poold goes on serving, the job ends as it would have, and SIGTERM still stops it cleanly."""
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg"), **JOBS_AS_ROOT}
    data = tmp_path / "data"
    config = tmp_path / "pool.toml"
    config.write_text('log_level = "info"\n')
    argv = [sys.executable, "-m", "daemon.main", "--config", str(config), "--data-dir", str(data)]
    argv += ["--web-listen", "off"]
    argv += ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"]
    master, terminal = os.openpty()

    def poolctl(*args: str, **env_: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "daemon.ctl.cli", *args]
        return subprocess.run(
            cmd, env={**env, **env_}, capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path
        )

    with subprocess.Popen(
        argv,
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        env=env,
        start_new_session=True,  # a session of its own, whose controlling terminal the pty becomes
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # noqa: PLW1509 - nothing else forks here
    ) as proc:
        os.close(terminal)
        try:
            said: list[str] = []
            read_until(master, said, "server ready on")
            started = tmp_path / "started"
            job = poolctl("enqueue", "--", "sh", "-c", f"touch {started}; sleep 2; echo survived")
            assert job.returncode == 0, job.stderr
            job_id = job.stdout.split()[0]
            newcomer = {"GPUPOOL_USER": "newcomer", "GPUPOOL_TOKEN": "the-newcomers-token-0123"}
            assert poolctl("ls", **newcomer).returncode != 0  # not in the tokens file yet
            with (data / "tokens.toml").open("a") as tokens_file:
                tokens_file.write('"newcomer" = "the-newcomers-token-0123"\n')
            deadline = time.monotonic() + 30
            while not started.exists():
                assert time.monotonic() < deadline, "the job did not start"
                time.sleep(0.05)
            config.write_text('log_level = "loud"\n')
            proc.send_signal(signal.SIGHUP)
            read_until(master, said, "SIGHUP: nothing reloaded, the running configuration is kept")
            config.write_text('log_level = "debug"\njob_name_max_chars = 16\nmax_connections = 50\n')
            proc.send_signal(signal.SIGHUP)
            log = read_until(master, said, "takes effect only at a restart")
            tokens = f"tokens file {data / 'tokens.toml'}: 2 users (added newcomer)"
            assert f"reloaded job_name_max_chars = 16; log_level = 'debug'; {tokens}" in log, log
            assert "SIGHUP: max_connections changed, which takes effect only at a restart" in log, log
            listed = poolctl("ls", **newcomer)
            assert listed.returncode == 0, listed.stderr
            named = poolctl("enqueue", "--name", "seventeen-letters", "--", "true")
            assert "job_name_max_chars" in named.stderr, named.stdout + named.stderr
            os.close(master)  # the terminal is gone: the kernel sends poold SIGHUP
            master = -1
            proc.send_signal(signal.SIGHUP)  # its log lines now fail with EIO
            waited = poolctl("wait", job_id)
            assert waited.returncode == 0, waited.stdout + waited.stderr
            assert "survived" in poolctl("logs", job_id).stdout
            assert proc.poll() is None
        finally:
            if master >= 0:
                os.close(master)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
