"""`poold` run as a user runs it (`make run`): it starts the embedded Redis, says where, and leaves
no redis-server behind when stopped."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from daemon.queue.embedded_redis import _is_redis_process
from daemon.worker.identity import DEFAULT_UIDS
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
        env={**os.environ, **JOBS_AS_ROOT},  # its local slots' jobs: the tests' own, as before
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
            assert _is_redis_process(pid)  # the first pool's Redis was not touched
            assert redis_pid(tmp_path) == pid
        finally:
            first.send_signal(signal.SIGTERM)
            assert first.wait(30) == 0


def test_the_embedded_pool_runs_jobs_on_its_own_slots(tmp_path: Path) -> None:
    """`make run`, then `poolctl enqueue` and `poolctl wait`: the job runs on the server's local slots
    (the Worker main.py hands the server), with no worker started separately."""
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
        finally:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(30) == 0


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
    """issue 44 item 8: a fresh root `poold --job-uid-range 61100-61103` refused to start on the
    data directory it had just made itself (0700: "the jobs' uids cannot pass through"), and
    the 32 slots of a single-machine pool wanted 32 uids. It makes that directory 0711 now, and
    runs as many slots as it has uids, saying so."""
    with root_pool("--job-uid-range", "61100-61103", "--worker-local-processors", "32") as (
        top,
        poolctl,
        said,
    ):
        assert "holds 4 uids for 32 slots: running 4 slots (give it 32 uids to run them all)" in said, said
        uid, output = run_a_job(top, poolctl)
    assert uid in range(61100, 61104)
    assert output == "written\n"
