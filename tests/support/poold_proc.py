"""`poold` as a separate process, started the way an admin would start it, for tests that need
blocking sockets (hypothesis) or real signals."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from daemon.queue.embedded_redis import EmbeddedRedis
from tests.support.cluster import ClusterGroup
from tests.support.s3server import shared_s3_env
from tests.support.sentinel import MASTER, SentinelGroup


@contextmanager
def poold(
    redis_server: EmbeddedRedis | SentinelGroup | ClusterGroup, tmp: Path, tokens: dict[str, str], *flags: str
) -> Iterator[str]:
    """Run a multinode `poold` on `redis_server` (one node, a Sentinel group's primary, or a
    Cluster); yields its client address."""
    with poold_process(redis_server, tmp, tokens, *flags) as (address, _):
        yield address


@contextmanager
def poold_process(
    redis_server: EmbeddedRedis | SentinelGroup | ClusterGroup, tmp: Path, tokens: dict[str, str], *flags: str
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`poold`, also yielding its process (to kill it). Its stderr is read until it says it is
    ready, then drained by a thread (a full pipe would stop the server at its next log line)."""
    tmp.mkdir(parents=True, exist_ok=True)
    tokens_file = tmp / "tokens.toml"
    tokens_file.write_text("".join(f'{u} = "{t}"\n' for u, t in tokens.items()))
    tokens_file.chmod(0o600)
    env = dict(
        os.environ,
        XDG_CONFIG_HOME=str(tmp / "xdg"),
        GPUPOOL_MAIN_SERVER_REDIS_PASSWORD=redis_server.password,
        **shared_s3_env(),  # a multinode server refuses to start without its bucket
    )
    where: list[str] = []  # a group is named in the environment
    if isinstance(redis_server, SentinelGroup):
        env.update(
            GPUPOOL_REDIS_SENTINELS=",".join(redis_server.sentinel_addresses),
            GPUPOOL_REDIS_SENTINEL_MASTER=MASTER,
            GPUPOOL_REDIS_SENTINEL_PASSWORD=redis_server.sentinel_password,
        )
    elif isinstance(redis_server, ClusterGroup):
        env.update(GPUPOOL_REDIS_CLUSTER_NODES=",".join(p.address for p in redis_server.processes()))
    else:
        where = ["--redis-port", str(redis_server.port)]
    argv = [
        sys.executable,
        "-m",
        "daemon.main",
        "--worker-mode",
        "multinode",
        *where,
        "--metrics-listen",
        "127.0.0.1:0",
        "--listen",
        "127.0.0.1:0",
        "--tokens-file",
        str(tokens_file),
        "--data-dir",
        str(tmp / "data"),
        *flags,
    ]
    with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env) as proc:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if "server ready on " in line:
                address = line.split("server ready on ", 1)[1].split(":", 2)
                break
        else:
            proc.wait(30)
            raise AssertionError("poold did not start:\n" + "".join(seen))
        drain = threading.Thread(target=proc.stderr.read, daemon=True)
        drain.start()
        try:
            yield f"{address[0]}:{address[1]}", proc
        finally:
            proc.terminate()
            proc.wait(30)
            drain.join(10)
