"""`poold` run as a user runs it (`make run`): it starts the embedded Redis, says where, and leaves
no redis-server behind when stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from daemon.queue.embedded_redis import _is_redis_process


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
    )


def wait_ready(proc: subprocess.Popen[str]) -> str:
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "server ready on" in line:
            return line
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
            env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "xdg2"))
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
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    argv = [sys.executable, "-m", "daemon.main", "--data-dir", str(tmp_path / "data")]
    argv += ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"]
    with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            wait_ready(proc)

            def poolctl(*args: str) -> subprocess.CompletedProcess[str]:
                cmd = [sys.executable, "-m", "daemon.ctl.cli", *args]
                return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=False)

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
