"""poold as systemd and an admin see it: readiness and watchdog over the notify socket, JSON logs,
no secret in any output, and a live worker's metrics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson

from daemon.queue.embedded_redis import EmbeddedRedis, free_port
from daemon.queue.job_queue import JobQueue
from tests.daemon.metrics.test_server_metrics import scrape, scrape_until
from tests.support.workers import JOBS_AS_ROOT, sh, wait_file, wait_until


def notify_socket(tmp: Path) -> tuple[socket.socket, str]:
    path = str(tmp / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    return sock, path


def test_ready_only_once_serving_then_watchdog_then_stopping(tmp_path: Path) -> None:
    sock, path = notify_socket(tmp_path)
    port = free_port()
    env = dict(
        os.environ,
        NOTIFY_SOCKET=path,
        WATCHDOG_USEC="200000",
        XDG_CONFIG_HOME=str(tmp_path / "xdg"),
        **JOBS_AS_ROOT,
    )
    argv = [
        sys.executable,
        "-m",
        "daemon.main",
        "--data-dir",
        str(tmp_path / "data"),
        "--listen",
        f"127.0.0.1:{port}",
        "--metrics-listen",
        "127.0.0.1:0",
        "--worker-local-processors",
        "1",
    ]
    with sock, subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL) as proc:
        try:
            messages: list[bytes] = []
            while not any(m.startswith(b"READY=1") for m in messages):
                messages.append(sock.recv(4096))
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass  # READY=1 came only once the port accepts connections
            watchdogs = 0
            while watchdogs < 3:
                if sock.recv(4096) == b"WATCHDOG=1":
                    watchdogs += 1
            proc.send_signal(signal.SIGTERM)
            while True:
                message = sock.recv(4096)
                if message.startswith(b"STOPPING=1"):
                    break
            assert proc.wait(30) == 0
        finally:
            proc.kill()


def test_json_logs_parse_and_no_secret_appears_anywhere(
    tmp_path: Path, redis_server: EmbeddedRedis, s3_env: dict[str, str]
) -> None:
    secret = redis_server.password
    env = dict(
        os.environ,
        XDG_CONFIG_HOME=str(tmp_path / "xdg"),
        GPUPOOL_MAIN_SERVER_REDIS_PASSWORD=secret,
        **s3_env,
        **JOBS_AS_ROOT,
    )
    common = [
        "--worker-mode",
        "multinode",
        "--redis-port",
        str(redis_server.port),
        "--log-format",
        "json",
        "--log-level",
        "debug",
        "--metrics-listen",
        "127.0.0.1:0",
    ]
    server = subprocess.Popen(
        [sys.executable, "-m", "daemon.main", *common, "--listen", "127.0.0.1:0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    worker = subprocess.Popen(
        [sys.executable, "-m", "daemon.main", "--worker", *common, "--data-dir", str(tmp_path / "w")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    time.sleep(3)
    printed = subprocess.run(
        [sys.executable, "-m", "daemon.main", *common, "--print-config"],
        env=env,
        capture_output=True,
        timeout=60,
        check=True,
    ).stdout
    outputs = [printed]
    for proc in (worker, server):
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        outputs += [out, err]
        lines = err.decode().splitlines()
        assert lines, "no log lines"
        for line in lines:
            record = orjson.loads(line)  # every line is one JSON object
            assert {"time", "level", "component", "message"} <= record.keys()
    everything = b"".join(outputs)
    assert secret.encode() not in everything
    assert s3_env["GPUPOOL_MAIN_SERVER_MINIO_SECRET_ACCESS_KEY"].encode() not in everything
    assert b"ready" in everything


async def test_a_live_worker_exports_its_slots_and_heartbeats(
    tmp_path: Path, redis_server: EmbeddedRedis, queue: JobQueue, s3_env: dict[str, str]
) -> None:
    port = free_port()
    env = dict(
        os.environ,
        XDG_CONFIG_HOME=str(tmp_path / "xdg"),
        GPUPOOL_MAIN_SERVER_REDIS_PASSWORD=redis_server.password,
        **s3_env,
        **JOBS_AS_ROOT,
    )
    argv = [
        sys.executable,
        "-m",
        "daemon.main",
        "--worker",
        "--worker-mode",
        "multinode",
        "--redis-port",
        str(redis_server.port),
        "--metrics-listen",
        f"127.0.0.1:{port}",
        "--data-dir",
        str(tmp_path / "w"),
        "--worker-healthy-response-period",
        "3",
    ]
    await queue.enqueue(sh("echo started > started; sleep 300", cwd=str(tmp_path)))
    with (
        open(tmp_path / "worker.log", "wb") as log,
        subprocess.Popen(argv, env=env, stderr=log) as proc,
    ):
        try:
            await wait_file(tmp_path / "started")
            busy = (("state", "busy"),)
            samples = await scrape_until(port, ("gpupool_worker_slots", busy), 1)
            assert samples[("gpupool_worker_slots", busy)] == 1
            assert samples[("gpupool_worker_slots", (("state", "free"),))] == 1
            assert not any(name.startswith("gpupool_gpu_") for name, _ in samples)  # no GPUs, no series
            samples = await scrape_until(port, ("gpupool_heartbeat_roundtrip_seconds_count", ()), 3)
            assert samples[("gpupool_heartbeat_roundtrip_seconds_count", ())] >= 1
            assert samples[("process_resident_memory_bytes", ())] > 0
            # issue 47 item 2: SIGHUP killed the worker and its job; it reloads now, and both go on.
            proc.send_signal(signal.SIGHUP)
            await wait_until(lambda: _logged(tmp_path / "worker.log", b"SIGHUP: reloaded"), 10, "the reload")
            samples = await scrape_until(port, ("gpupool_worker_slots", busy), 1)
            assert proc.poll() is None
        finally:
            proc.send_signal(signal.SIGTERM)
            # Two signals sent back to back can reach the handler as one: send the second (stop
            # the job now, hand it back) once the first has been seen.
            with contextlib.suppress(AssertionError):
                await wait_until(
                    lambda: _logged(tmp_path / "worker.log", b"draining"), 10, "the worker to drain"
                )
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 60)
    assert await scrape_fails(port)


async def _logged(path: Path, text: bytes) -> bool:
    return text in path.read_bytes()


async def scrape_fails(port: int) -> bool:
    try:
        await scrape(port)
    except OSError:
        return True
    return False
