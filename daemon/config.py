"""The pool's configuration: the `Config` its options load into, the layered loader, and what is
derived from it (the data directory, the heartbeat's period, the flags).

Precedence: command-line flag > ``GPUPOOL_<NAME>`` environment variable > TOML file > default.
Every option is one `Option` row of daemon/options.py (daemon/option_values.py checks each value);
its TOML key, its env variable (``GPUPOOL_`` + upper case) and its flag (``--name-with-dashes``) all
come from its name. Secrets may instead be read from a file (``<name>_file`` in any layer) so they
need not sit in the TOML or the process table.

A bad value stops start-up with one line: the key, where it came from (file:line, env var or flag)
and what was expected (`ConfigError`, exit status 2). Reading the sources themselves (the file with
its line numbers, the environment, the flags, secret files) is daemon/config_sources.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.address import parse_host_port
from daemon.config_sources import ENV_PREFIX, Layer, from_env, from_flags, read_secret, read_toml
from daemon.errors import ConfigError, GpupoolError
from daemon.option_values import convert, uid_range_of
from daemon.options import BY_NAME, OPTIONS, RENAMED, SECRET_NAMES

# The table's names that tests read through this module are re-exported with it.
__all__ = [
    "BY_NAME",
    "DEFAULT_CONFIG_FILE",
    "HAND_BACK_SECONDS",
    "OPTIONS",
    "ROOT_DATA_DIR",
    "SECRET_NAMES",
    "Config",
    "add_flags",
    "load",
    "make_data_dir",
    "uid_range_of",
]

DEFAULT_CONFIG_FILE = Path("/etc/gpupool/pool.toml")
# What a worker's hand-back of a job it stopped needs once the job's last process is gone (its last
# log lines, the release's round trip): a pilot keeps it free before its end (worker/lifetime.py).
HAND_BACK_SECONDS = 1.0

# A root daemon's data_dir when none is configured (an admin's `make run`): the jobs' uids must
# pass through it to their slots' directories, and no home directory of root's lets them.
ROOT_DATA_DIR = Path("/var/lib/gpupool")


@dataclass(frozen=True, slots=True)
class Config:
    worker_mode: str
    redis_ip: str
    redis_port: int
    redis_db: int
    redis_username: str
    main_server_redis_password: str
    redis_sentinels: list[str]
    redis_cluster_nodes: list[str]
    redis_sentinel_master: str
    redis_sentinel_password: str
    redis_min_replicas_ack: int
    redis_replicas_ack_timeout: float
    redis_appendfsync: str
    redis_max_memory: int
    main_server_minio_address: str
    main_server_minio_access_key_id: str
    main_server_minio_secret_access_key: str
    main_server_minio_bucket: str
    main_server_minio_bucket_ping_timeout: float
    local_minio_port: int
    worker_local_processors: int
    worker_remote_processors: int
    worker_cache_bytes: int
    worker_env_cache_bytes: int
    worker_env_index_url: str
    worker_env_extra_index_urls: list[str]
    worker_env_find_links: list[str]
    worker_env_python_downloads: bool
    worker_env_allow_source_builds: bool
    worker_reserved_mem: int
    gpu_max_jobs: int
    gpu_health_policy: str
    gpu_health_clear: float
    idle_gpu_util: float
    idle_gpu_minutes: float
    idle_gpu_grace_minutes: float
    idle_gpu_requeue_queues: list[str]
    idle_gpu_cancel_queues: list[str]
    fast_path: bool
    worker_healthy_response_period: float
    redis_events_block_ms: float
    heartbeat_interval: float
    job_uid_range: str
    job_network: str
    drain_timeout: float
    kill_grace: float
    shell_idle_limit: float
    worker_idle_exit: float
    worker_max_lifetime: float
    worker_serve_user: str
    worker_via_server: str
    worker_token_file: str
    job_nice: int
    job_retention: float
    accounting_retention_days: int
    retry_backoff: float
    retry_backoff_max: float
    job_log_max_bytes: int
    dead_worker_retention: float
    queues: list[str]
    queue_default_cpus: list[str]
    queue_default_mem: list[str]
    fairshare_queues: list[str]
    fairshare_half_life: float
    preempt_queues: list[str]
    default_max_priority: int
    user_max_running_jobs: int
    user_max_gpus: int
    user_max_queued_jobs: int
    user_max_stored_bytes: int
    job_spec_max_bytes: int
    project_max_bytes: int
    job_name_max_chars: int
    data_dir: str
    listen: str
    metrics_listen: str
    web_listen: str
    web_hosts: list[str]
    max_connections: int
    max_connections_per_user: int
    max_frame_size: int
    handshake_timeout: float
    idle_timeout: float
    tokens_file: str
    tls: str
    tls_cert: str
    tls_key: str
    notify_url: str
    notify_secret: str
    notify_allow: list[str]
    notify_timeout: float
    log_format: str
    log_level: str
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
    renamed: tuple[str, ...] = ()  # a sentence for each option given by its old name

    @property
    def embedded(self) -> bool:
        return self.worker_mode == "singlenode"

    @property
    def leaving_seconds(self) -> float:
        """Seconds a worker takes to leave by itself (a pilot at its end, worker/lifetime.py): its
        drain, a job's stop grace (kill_grace), and the hand-back of what it stopped."""
        return self.drain_timeout + self.kill_grace + HAND_BACK_SECONDS

    @property
    def heartbeat_seconds(self) -> float:
        """At most a third of the lease, so two heartbeats can be lost before a worker is dead."""
        period = self.worker_healthy_response_period
        return min(self.heartbeat_interval or period / 10, period / 3)

    def listen_address(self) -> tuple[str, int]:
        return parse_host_port(self.listen)

    def data_path(self) -> Path:
        if self.data_dir:
            return Path(self.data_dir).expanduser()
        if state := os.environ.get("STATE_DIRECTORY"):  # systemd's StateDirectory=
            return Path(state.split(":")[0])
        if xdg := os.environ.get("XDG_DATA_HOME"):
            return Path(xdg) / "gpupool"
        return ROOT_DATA_DIR if os.geteuid() == 0 else Path.home() / ".local" / "share" / "gpupool"

    def shown(self) -> dict[str, Any]:
        """The effective values with secrets masked, for --print-config and logs."""
        return {
            o.name: ("********" if o.secret and getattr(self, o.name) else getattr(self, o.name))
            for o in OPTIONS
        }


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per option (``--redis-port 6380``); `load` reads them from the parsed namespace."""
    group = parser.add_argument_group("configuration (flag > GPUPOOL_* env > file > default)")
    group.add_argument(
        "--config", metavar="FILE", help=f"TOML file (default {DEFAULT_CONFIG_FILE} if present)"
    )
    for o in OPTIONS:
        flag = "--" + o.name.replace("_", "-")
        if o.type is bool:
            group.add_argument(flag, dest=o.name, default=None, action=argparse.BooleanOptionalAction)
        else:
            # argparse formats help with %: an option's text is shown as written ("90%").
            shown = o.help.replace("%", "%%")
            group.add_argument(flag, dest=o.name, default=None, metavar=o.name.upper(), help=shown)
        if o.secret:
            group.add_argument(
                flag + "-file",
                dest=o.name + "_file",
                default=None,
                metavar="FILE",
                help=f"read {o.name} from FILE",
            )


def load(
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
) -> Config:
    """Merge the layers. Raises ConfigError naming the key, its source and what was expected."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {o.name: o.default for o in OPTIONS}
    sources: dict[str, str] = dict.fromkeys(values, "default")

    path = config_file or (args and getattr(args, "config", None)) or env.get(ENV_PREFIX + "CONFIG")
    if path is None and DEFAULT_CONFIG_FILE.is_file():
        path = DEFAULT_CONFIG_FILE
    layers = [read_toml(Path(path))] if path is not None else []
    layers.append(from_env(env))
    if args is not None:
        layers.append(from_flags(args, [(o.name, o.secret) for o in OPTIONS]))
    renamed = []
    for layer in layers:
        for i, (key, raw, source, is_text) in enumerate(layer):
            if (new := RENAMED.get(key)) is not None:
                renamed.append(f"{source}: {key} is now called {new}; rename it there")
                layer[i] = (new, raw, source, is_text)
        _apply(values, sources, layer)
    loaded = Config(**values, sources=sources, renamed=tuple(renamed))
    _check_together(loaded)
    return loaded


def make_data_dir(path: Path) -> None:
    """Create the data directory, and each missing directory above it: 0711 for a root daemon,
    whose jobs' uids pass through it to their slots' directories and list nothing (what is
    secret in it is 0600 or 0700 itself); 0700 for any other, whose jobs run as itself. A
    directory already there is left as it is."""
    mode = 0o711 if os.geteuid() == 0 else 0o700
    missing = [d for d in (path, *path.parents) if not d.exists()]
    try:
        for directory in reversed(missing):
            directory.mkdir(mode=mode, exist_ok=True)
            directory.chmod(mode)  # whatever the umask took (the worker unit's is 0027)
    except OSError as exc:
        raise GpupoolError(f"cannot make the data directory {path}: {exc}; give data_dir elsewhere") from None


def _check_together(c: Config) -> None:
    """Refuse options that cannot work together, saying what to do instead."""
    if c.embedded:  # its own Redis: one node, no sentinels, no replicas
        for name in ("redis_sentinels", "redis_cluster_nodes", "redis_min_replicas_ack"):
            if getattr(c, name):
                raise ConfigError(
                    name,
                    c.sources[name],
                    "a singlenode pool runs its own Redis, one node with no sentinels and no "
                    "replicas: set worker_mode = multinode with the pool's Redis, or leave this unset",
                )
    if c.worker_via_server:  # an agent worker: it signs in to the server as one user, with a token
        for name, what in (
            ("worker_serve_user", "the pool user it acts as"),
            ("worker_token_file", "that user's token"),
        ):
            if not getattr(c, name):
                raise ConfigError(
                    name,
                    c.sources[name],
                    f"a worker through the server (worker_via_server) needs {name}: {what}, with which "
                    "it signs in; it holds no Redis or S3 credential of its own",
                )
    if c.redis_sentinels and c.redis_cluster_nodes:
        raise ConfigError(
            "redis_cluster_nodes",
            c.sources["redis_cluster_nodes"],
            "a pool's Redis is either a Sentinel group (redis_sentinels) or a Cluster, not both: a "
            "Cluster fails over by itself; keep one of the two",
        )
    if both := sorted(set(c.idle_gpu_requeue_queues) & set(c.idle_gpu_cancel_queues)):
        raise ConfigError(
            "idle_gpu_cancel_queues",
            c.sources["idle_gpu_cancel_queues"],
            f"{', '.join(both)} also in idle_gpu_requeue_queues: a queue's jobs left idle are either "
            "requeued or cancelled; name each queue in one of the two",
        )
    if c.redis_cluster_nodes and c.redis_db:
        raise ConfigError(
            "redis_db", c.sources["redis_db"], "a Redis Cluster has database 0 only: leave redis_db unset"
        )


def _apply(values: dict[str, Any], sources: dict[str, str], layer: Layer) -> None:
    seen: dict[str, str] = {}
    for key, raw, source, is_text in layer:
        name, from_file = key, False
        if key.endswith("_file") and key[: -len("_file")] in SECRET_NAMES:
            name, from_file = key[: -len("_file")], True
        option = BY_NAME.get(name)
        if option is None:
            raise ConfigError(key, source, f"unknown option; known options: {', '.join(BY_NAME)}")
        if name in seen:
            raise ConfigError(
                key, source, f"also given as {seen[name]}: give the value or the file, not both"
            )
        seen[name] = source
        if from_file:
            values[name] = convert(option, read_secret(key, raw, source), source, is_text=True)
        else:
            values[name] = convert(option, raw, source, is_text)
        sources[name] = source
