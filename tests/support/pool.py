"""A pool server in the test's own event loop, on a real Redis and a real loopback port."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon import config
from daemon.client.pool_client import PoolClient
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.server.agents import AgentWorkerFactory
from daemon.server.service import PoolServer
from storage.base import ObjectStore
from storage.s3 import S3Store
from tests.support.s3server import S3Server, shared_s3_env

USERS = ("alice", "bob")


@dataclass
class Pool:
    server: PoolServer
    address: str
    tokens: dict[str, str]
    tokens_file: Path

    @property
    def queue(self) -> JobQueue:
        assert self.server.queue is not None
        return self.server.queue

    def client(self, user: str = "alice", token: str | None = None) -> PoolClient:
        return PoolClient(self.address, user, self.tokens[user] if token is None else token)

    def env(self, user: str = "alice", **extra: str) -> dict[str, str]:
        """Environment for a `poolctl` subprocess talking to this pool as `user`."""
        import os

        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.tokens_file.parent),
            "XDG_CONFIG_HOME": str(self.tokens_file.parent / "xdg"),
            "GPUPOOL_SERVER": self.address,
            "GPUPOOL_USER": user,
            "GPUPOOL_TOKEN": self.tokens[user],
            **extra,
        }


def pool_config(
    redis_server: EmbeddedRedis,
    tmp: Path,
    users: tuple[str, ...] = USERS,
    admins: tuple[str, ...] = (),
    *,
    max_priority: Mapping[str, int] | None = None,
    **overrides: Any,
) -> config.Config:
    """A multinode server's configuration with a token for each of `users`; `admins` are marked as
    the pool's admins in the tokens file, and users in `max_priority` given that ceiling."""
    tokens = {u: secrets.token_urlsafe(24) for u in users}
    ceilings = max_priority or {}

    def entry(user: str, token: str) -> str:
        extra = (", admin = true" if user in admins else "") + (
            f", max_priority = {ceilings[user]}" if user in ceilings else ""
        )
        return f'"{user}" = {{ token = "{token}"{extra} }}\n'

    tokens_file = tmp / "tokens.toml"
    tokens_file.write_text("".join(entry(u, t) for u, t in tokens.items()))
    tokens_file.chmod(0o600)
    values = {
        "worker_mode": "multinode",
        "redis_ip": "127.0.0.1",
        "redis_port": redis_server.port,
        "main_server_redis_password": redis_server.password,
        "listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
        "web_listen": "127.0.0.1:0",
        "tokens_file": str(tokens_file),
        "data_dir": str(tmp / "data"),
        "redis_events_block_ms": 1000.0,
        **shared_bucket(),  # a multinode server refuses to start without its bucket
        **overrides,
    }
    c = config.load(None, env={}, config_file=None)
    import dataclasses

    return dataclasses.replace(c, **values)


def shared_bucket() -> dict[str, str]:
    """The main_server_minio_* options naming the test process's shared bucket (s3server.py)."""
    return {k.removeprefix("GPUPOOL_").lower(): v for k, v in shared_s3_env().items()}


@asynccontextmanager
async def running_pool(
    redis_server: EmbeddedRedis,
    tmp: Path,
    store: ObjectStore | None = None,
    users: tuple[str, ...] = USERS,
    admins: tuple[str, ...] = (),
    *,
    max_priority: Mapping[str, int] | None = None,
    agent_workers: AgentWorkerFactory | None = None,
    **overrides: Any,
) -> AsyncIterator[Pool]:
    """A started server with a token for each of `users`; `store` replaces the one its
    configuration names (the server opens and closes it); `agent_workers` builds the worker it
    runs for each agent (daemon.worker.hosted.hosted_worker; None: it runs none)."""
    cfg = pool_config(redis_server, tmp, users, admins, max_priority=max_priority, **overrides)
    server = PoolServer(cfg, agent_workers=agent_workers)
    if store is not None:
        server.store = store
    await server.start()
    try:
        assert server.listener is not None
        from daemon.tokens import read_tokens

        tokens = {u: t.decode() for u, t in read_tokens(Path(cfg.tokens_file)).items()}
        yield Pool(server, server.listener.address, tokens, Path(cfg.tokens_file))
    finally:
        await server.stop()


async def fresh_bucket(s3_server: S3Server) -> S3Store:
    """A store on a new bucket of the session's S3 server, for a pool of a test's own (the
    server that is handed it opens and closes it)."""
    store = S3Store(
        s3_server.endpoint.removeprefix("http://"),
        f"p-{secrets.token_hex(6)}",
        s3_server.access_key,
        s3_server.secret_key,
    )
    async with store:
        await store.ensure_bucket()
    return store
