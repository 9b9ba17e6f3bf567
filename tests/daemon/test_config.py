"""Configuration: precedence, types, ranges, secrets from files, and the one-line error."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from daemon import config
from daemon.errors import ConfigError
from tests.support.paths import ROOT


def flags(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    config.add_flags(p)
    return p.parse_args(argv)


def test_defaults_match_the_design_table() -> None:
    c = config.load(flags(), env={})
    assert (c.worker_mode, c.redis_ip, c.redis_port, c.redis_db) == ("singlenode", "127.0.0.1", 6379, 0)
    assert (c.worker_local_processors, c.worker_remote_processors) == (-1, 2)
    assert c.worker_healthy_response_period == 300.0
    assert c.redis_events_block_ms == 1000.0
    assert c.main_server_minio_bucket == "gpupool"
    assert c.main_server_minio_bucket_ping_timeout == 30.0
    assert c.heartbeat_seconds == 30.0
    assert c.listen_address() == ("127.0.0.1", 7420)


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    toml = tmp_path / "pool.toml"
    toml.write_text(
        "redis_port = 7000\nredis_db = 3\nworker_remote_processors = 4\nqueues = ['high', 'low']\n"
    )
    env = {"GPUPOOL_REDIS_PORT": "7001", "GPUPOOL_REDIS_DB": "5"}
    c = config.load(flags("--config", str(toml), "--redis-port", "7002"), env=env)
    assert (c.redis_port, c.redis_db, c.worker_remote_processors, c.queues) == (7002, 5, 4, ["high", "low"])
    assert c.sources["redis_port"] == "--redis-port"
    assert c.sources["redis_db"] == "GPUPOOL_REDIS_DB"
    assert c.sources["worker_remote_processors"] == f"{toml}:3"
    assert c.sources["redis_ip"] == "default"
    assert config.load(flags(), env={"GPUPOOL_QUEUES": "a, b"}).queues == ["a", "b"]


@pytest.mark.parametrize(
    ("text", "where", "words"),
    [
        ("redis_prot = 1\n", ":1: redis_prot: unknown option", "known options"),
        ("\n\nredis_port = 'x'\n", ":3: redis_port: 'x' is not valid", "an integer from 1 to 65535"),
        ("worker_remote_processors = 0\n", ":1: worker_remote_processors: 0 is not valid", "from 1 to 4096"),
        ("worker_mode = 'cluster'\n", ":1: worker_mode: 'cluster' is not valid", "singlenode, multinode"),
        ("listen = '127.0.0.1'\n", ":1: listen: '127.0.0.1' is not valid", "HOST:PORT"),
        ("redis_db = true\n", ":1: redis_db: True is not valid", "an integer"),
        ("redis_port = [\n", ": config: not valid TOML", "Invalid value"),
    ],
)
def test_bad_file_values_name_key_line_and_expectation(
    tmp_path: Path, text: str, where: str, words: str
) -> None:
    toml = tmp_path / "pool.toml"
    toml.write_text(text)
    with pytest.raises(ConfigError) as err:
        config.load(flags("--config", str(toml)), env={})
    message = str(err.value)
    assert message.startswith(str(toml) + where)
    assert words in message
    assert "\n" not in message


def test_bad_env_and_flag_values_name_their_source() -> None:
    with pytest.raises(
        ConfigError, match=r"^GPUPOOL_WORKER_HEALTHY_RESPONSE_PERIOD: worker_healthy_response_period"
    ):
        config.load(flags(), env={"GPUPOOL_WORKER_HEALTHY_RESPONSE_PERIOD": "soon"})
    with pytest.raises(ConfigError, match=r"^--redis-port: redis_port: '99999' is not valid"):
        config.load(flags("--redis-port", "99999"), env={})
    with pytest.raises(ConfigError, match=r"^GPUPOOL_NOPE: nope: unknown option"):
        config.load(flags(), env={"GPUPOOL_NOPE": "1"})
    with pytest.raises(ConfigError, match="not valid"):
        config.load(flags(), env={"GPUPOOL_WORKER_HEALTHY_RESPONSE_PERIOD": "nan"})


def test_a_dashboard_host_name_with_a_port_is_refused_saying_what_to_write() -> None:
    with pytest.raises(
        ConfigError, match=r"'pool.lab:7421': a name without its port \(web_listen's\), e.g. 'pool.lab'"
    ):
        config.load(flags(), env={"GPUPOOL_WEB_HOSTS": "pool.lab:7421"})
    loaded = config.load(flags(), env={"GPUPOOL_WEB_HOSTS": "pool.lab,::1,[fe80::1]"})
    assert loaded.web_hosts == ["pool.lab", "::1", "[fe80::1]"]


def test_secrets_from_files_and_masked(tmp_path: Path) -> None:
    secret = tmp_path / "redis-password"
    secret.write_text("s3cr3t-value\n")
    c = config.load(flags(), env={"GPUPOOL_MAIN_SERVER_REDIS_PASSWORD_FILE": str(secret)})
    assert c.main_server_redis_password == "s3cr3t-value"
    assert c.shown()["main_server_redis_password"] == "********"
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(flags(), env={"GPUPOOL_MAIN_SERVER_REDIS_PASSWORD_FILE": str(tmp_path / "missing")})
    both = {"GPUPOOL_MAIN_SERVER_REDIS_PASSWORD": "x", "GPUPOOL_MAIN_SERVER_REDIS_PASSWORD_FILE": str(secret)}
    with pytest.raises(ConfigError, match="not both"):
        config.load(flags(), env=both)
    bad = tmp_path / "bad.toml"
    bad.write_text("main_server_redis_password = 5\n")
    with pytest.raises(ConfigError) as err:
        config.load(flags("--config", str(bad)), env={})
    assert "5" not in str(err.value).split(":", 3)[-1].replace("expected", "")


def poold(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "daemon.main", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_poold_bad_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    toml = tmp_path / "pool.toml"
    toml.write_text("worker_remote_processors = -1\n")
    out = poold("--config", str(toml))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"poold: {toml}:1: worker_remote_processors: -1 is not valid: expected an integer from 1 to 4096"
    ]
    assert "Traceback" not in out.stderr
    assert out.stdout == ""
    missing = poold("--config", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2
    assert "cannot read the file" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


def test_poold_print_config_masks_secrets(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "GPUPOOL_MAIN_SERVER_REDIS_PASSWORD": "hunter2-secret"}
    out = poold("--print-config", "--redis-port", "6380", env=env)
    assert out.returncode == 0, out.stderr
    assert "hunter2-secret" not in out.stdout + out.stderr
    assert "main_server_redis_password = '********'  # GPUPOOL_MAIN_SERVER_REDIS_PASSWORD" in out.stdout
    assert "redis_port = 6380  # --redis-port" in out.stdout


def test_poold_print_config_into_a_closed_pipe_says_nothing(tmp_path: Path) -> None:
    """`poold --print-config | head -1` (a reader gone before poold has written it all) printed a
    BrokenPipeError traceback: it stops writing quietly, as poolctl does."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone before the first line
    try:
        done = subprocess.run(
            [sys.executable, "-m", "daemon.main", "--print-config"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            env={"PATH": "/usr/bin:/bin"},
            cwd=ROOT,
            check=False,
        )
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == 0


def test_readme_documents_every_option() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [
        o.name for o in config.OPTIONS if f"| `{o.name}`" not in readme and f"`{o.name}`, " not in readme
    ]
    assert missing == [], f"README.md's configuration table lacks {missing}"


def test_an_option_given_by_its_old_name_is_read_and_named_for_renaming(tmp_path: Path) -> None:
    toml = tmp_path / "pool.toml"
    toml.write_text("redis_result_queue_polling_interval = 250.0\n")
    c = config.load(flags(), env={}, config_file=toml)
    assert c.redis_events_block_ms == 250.0
    old, new = "redis_result_queue_polling_interval", "redis_events_block_ms"
    assert c.renamed == (f"{toml}:1: {old} is now called {new}; rename it there",)
    c = config.load(flags(), env={"GPUPOOL_REDIS_RESULT_QUEUE_POLLING_INTERVAL": "300"})
    assert (c.redis_events_block_ms, len(c.renamed)) == (300.0, 1)


def test_sentinels_are_addresses_and_a_singlenode_pool_refuses_them(tmp_path: Path) -> None:
    multinode = {"GPUPOOL_WORKER_MODE": "multinode"}
    c = config.load(env={**multinode, "GPUPOOL_REDIS_SENTINELS": "10.0.0.1:26379, [::1]:26380"})
    assert c.redis_sentinels == ["10.0.0.1:26379", "[::1]:26380"]
    with pytest.raises(ConfigError, match=r"redis_sentinels: .*'sentinel-1': expected HOST:PORT"):
        config.load(env={**multinode, "GPUPOOL_REDIS_SENTINELS": "10.0.0.1:26379,sentinel-1"})
    # A wait for replicas longer than a reply is waited for would time the reply out first.
    with pytest.raises(
        ConfigError, match=r"redis_replicas_ack_timeout: '5' is not valid: expected a number from"
    ):
        config.load(env={**multinode, "GPUPOOL_REDIS_REPLICAS_ACK_TIMEOUT": "5"})
    # The embedded Redis has neither: said at once, in one line, rather than every submit failing.
    out = poold("--redis-min-replicas-ack", "1", "--data-dir", str(tmp_path))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "poold: --redis-min-replicas-ack: redis_min_replicas_ack: a singlenode pool runs its own Redis, "
        "one node with no sentinels and no replicas: set worker_mode = multinode with the pool's "
        "Redis, or leave this unset"
    ]


def test_cluster_nodes_are_addresses_and_exclude_sentinels_and_a_database(tmp_path: Path) -> None:
    multinode = {"GPUPOOL_WORKER_MODE": "multinode"}
    c = config.load(env={**multinode, "GPUPOOL_REDIS_CLUSTER_NODES": "10.0.0.1:6379,10.0.0.2:6379"})
    assert c.redis_cluster_nodes == ["10.0.0.1:6379", "10.0.0.2:6379"]
    with pytest.raises(ConfigError, match=r"redis_cluster_nodes: .*'redis-1': expected HOST:PORT"):
        config.load(env={**multinode, "GPUPOOL_REDIS_CLUSTER_NODES": "redis-1"})
    both = {
        **multinode,
        "GPUPOOL_REDIS_CLUSTER_NODES": "10.0.0.1:6379",
        "GPUPOOL_REDIS_SENTINELS": "10.0.0.1:26379",
    }
    with pytest.raises(ConfigError, match=r"either a Sentinel group .* or a Cluster, not both"):
        config.load(env=both)
    with pytest.raises(ConfigError, match=r"redis_db: .*a Redis Cluster has database 0 only"):
        config.load(
            env={**multinode, "GPUPOOL_REDIS_CLUSTER_NODES": "10.0.0.1:6379", "GPUPOOL_REDIS_DB": "2"}
        )
    out = poold("--redis-cluster-nodes", "127.0.0.1:7000", "--data-dir", str(tmp_path))
    assert out.returncode == 2
    assert "redis_cluster_nodes: a singlenode pool runs its own Redis" in out.stderr


def test_gpu_max_jobs_is_at_least_one_job_per_gpu(tmp_path: Path) -> None:
    assert config.load(flags(), env={}).gpu_max_jobs == 4
    assert config.load(flags("--gpu-max-jobs", "2"), env={}).gpu_max_jobs == 2
    assert config.load(flags(), env={"GPUPOOL_GPU_MAX_JOBS": "1"}).gpu_max_jobs == 1
    with pytest.raises(
        ConfigError, match=r"^--gpu-max-jobs: gpu_max_jobs: '0' is not valid: expected an integer >= 1"
    ):
        config.load(flags("--gpu-max-jobs", "0"), env={})
    toml = tmp_path / "pool.toml"
    toml.write_text("gpu_max_jobs = 2.5\n")
    with pytest.raises(ConfigError, match=r"pool\.toml:1: gpu_max_jobs: 2\.5 is not valid"):
        config.load(flags("--config", str(toml)), env={})


def test_jobs_run_as_root_only_by_an_explicit_job_uid_range_and_root_keeps_its_data_in_var_lib(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """issue 44 item 8: `job_uid_range = "root"` is the one way to run jobs as root (empty: a root
    worker leases uids); a misspelling says both forms. A root daemon with no data_dir keeps its
    data where the jobs' uids may pass (root's home is 0700)."""
    assert config.load(flags(), env={"GPUPOOL_JOB_UID_RANGE": "root"}).job_uid_range == "root"
    with pytest.raises(ConfigError, match=r"'roots' is not valid: expected FIRST-LAST, .*, or \"root\""):
        config.load(flags("--job-uid-range", "roots"), env={})
    for name in ("STATE_DIRECTORY", "XDG_DATA_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert config.load(flags(), env={}).data_path() == Path("/var/lib/gpupool")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert config.load(flags(), env={}).data_path() == Path.home() / ".local" / "share" / "gpupool"


@pytest.mark.parametrize("program", ["daemon.main", "daemon.ctl.cli"])
def test_help_is_printed_whatever_an_options_text_holds(program: str) -> None:
    """`poold --help` printed a traceback (issue 44 review): an option's help said "90%", which
    argparse reads as a format. Every option's text reaches --help as written."""
    done = subprocess.run(
        [sys.executable, "-m", program, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    if program == "daemon.main":
        assert "90%" in " ".join(done.stdout.split())  # redis_max_memory's help, as written


def test_the_fast_path_is_one_switch_on_by_default_that_reaches_the_queue() -> None:
    """issue 46: the GPU-less fast path has one switch, `fast_path`, on unless set off, and the
    JobQueue a daemon builds from its configuration carries it (daemon/queue/fast_path.py)."""
    from redis.asyncio import Redis

    from daemon.queue.job_queue import JobQueue

    assert config.load(flags(), env={}).fast_path is True
    off = config.load(flags("--no-fast-path"), env={})
    assert off.fast_path is False
    assert config.load(flags(), env={"GPUPOOL_FAST_PATH": "false"}).fast_path is False
    assert JobQueue.from_config(Redis(), off).fast_path is False
    assert JobQueue.from_config(Redis(), config.load(flags(), env={})).fast_path is True


def test_the_local_slots_by_default_are_the_machines_gpus_or_else_its_cores() -> None:
    """Issue 47 item 7: a single-machine pool ran 32 slots by default, on a 2-core machine too.
    By default it runs a job on each GPU NVML finds, or on each CPU core where it finds none; a
    number given is kept, 0 (no local slots) among them."""
    from daemon.worker import gpus
    from daemon.worker.service import local_slot_count

    assert local_slot_count(config.load(flags(), env={})) == (gpus.count() or len(os.sched_getaffinity(0)))
    for given in ("0", "3"):
        assert local_slot_count(config.load(flags("--worker-local-processors", given), env={})) == int(given)


def test_a_queue_cannot_both_requeue_and_cancel_idle_gpu_jobs() -> None:
    """Issue 50, idle GPUs: a queue named in both idle_gpu_* policy lists is refused at start with
    a sentence naming it, rather than one policy silently winning."""
    c = config.load(env={"GPUPOOL_IDLE_GPU_REQUEUE_QUEUES": "a", "GPUPOOL_IDLE_GPU_CANCEL_QUEUES": "b"})
    assert (c.idle_gpu_requeue_queues, c.idle_gpu_cancel_queues) == (["a"], ["b"])
    both = {"GPUPOOL_IDLE_GPU_REQUEUE_QUEUES": "a,b", "GPUPOOL_IDLE_GPU_CANCEL_QUEUES": "b"}
    with pytest.raises(ConfigError, match=r"idle_gpu_cancel_queues: .*b also in idle_gpu_requeue_queues"):
        config.load(env=both)


def test_a_queues_default_memory_is_a_mib_at_least() -> None:
    """issue 50, a review's finding 12: `queue_default_mem = ["gpu=4096"]` (a MiB meant) gave every
    job of that queue asking for no --mem a limit of 4096 bytes: each killed at once. The config
    refuses a default under a MiB, saying what the bytes would be."""
    assert config.load(flags(), env={"GPUPOOL_QUEUE_DEFAULT_MEM": "gpu=1048576"}).queue_default_mem == [
        "gpu=1048576"
    ]
    with pytest.raises(
        ConfigError, match=r"'gpu=4096': '4096' is 4096 bytes, less than a MiB: bytes, e\.g\. 4294967296"
    ):
        config.load(flags(), env={"GPUPOOL_QUEUE_DEFAULT_MEM": "gpu=4096"})
