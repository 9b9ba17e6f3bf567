"""The table of the pool's options: one typed `Option` row each (daemon/option_values.py says what
a row holds and how a value is checked against it).

Every option is one `Option` row of `OPTIONS`: its name gives its TOML key, its env variable
(``GPUPOOL_`` + upper case) and its flag (``--name-with-dashes``); its type, range, choices and
`check` say what a value must be, and `convert` (option_values.py) turns a raw value into the typed
one or raises `ConfigError` saying what was expected. The table is the reference for every option
(README's table is checked against it); daemon/config.py merges the layers into a `Config` through it.
"""

from __future__ import annotations

from daemon.address import SERVER_PORT, check_host_names, parse_host_port, parse_host_ports
from daemon.option_values import Option, job_uid_range_of, queue_cpus, queue_mem
from daemon.webhook import check_url
from daemon.webhook_targets import Allowed

SERVER_METRICS_PORT = 9420
WORKER_METRICS_PORT = 9421
WEB_PORT = 7421

OPTIONS: tuple[Option, ...] = (
    Option(
        "worker_mode",
        str,
        "singlenode",
        "singlenode: embedded Redis and local store; multinode: the external Redis and MinIO below",
        choices=("singlenode", "multinode"),
    ),
    Option("redis_ip", str, "127.0.0.1", "the pool's Redis host (multinode)"),
    Option("redis_port", int, 6379, "the pool's Redis port (multinode)", lo=1, hi=65535),
    Option("redis_db", int, 0, "Redis database number", lo=0, hi=15),
    Option("redis_username", str, "", "Redis ACL user (empty: the default user)"),
    Option("main_server_redis_password", str, "", "Redis password", secret=True),
    Option(
        "redis_sentinels",
        list,
        [],
        "Redis Sentinel addresses HOST:PORT (multinode): the primary is asked of them, and found "
        "again after a failover; redis_ip and redis_port are then unused",
        check=parse_host_ports,
    ),
    Option(
        "redis_cluster_nodes",
        list,
        [],
        "Redis Cluster nodes HOST:PORT (multinode), any of them: the cluster is found from them, "
        "queues spread over its shards; redis_ip and redis_port are then unused",
        check=parse_host_ports,
    ),
    Option("redis_sentinel_master", str, "gpupool", "the name the sentinels monitor the pool's Redis by"),
    Option("redis_sentinel_password", str, "", "password of the sentinels themselves", secret=True),
    Option(
        "redis_min_replicas_ack",
        int,
        0,
        "replicas a submit and a job's outcome must reach (WAIT) before they are acknowledged; "
        "0: the primary's word is enough",
        lo=0,
        hi=64,
    ),
    Option(
        "redis_replicas_ack_timeout",
        float,
        1.0,
        "seconds a write waits for redis_min_replicas_ack replicas; one that does not reach them "
        "fails, saying so (at most half the 5 s a reply is waited for)",
        lo=0.001,
        hi=2.5,
    ),
    Option(
        "redis_appendfsync",
        str,
        "everysec",
        "embedded Redis AOF fsync policy: always loses nothing on a crash, everysec may lose the last second",
        choices=("always", "everysec"),
    ),
    Option(
        "redis_max_memory",
        int,
        0,
        "bytes the embedded Redis may hold (its maxmemory, noeviction; 0: a quarter of this "
        "machine's memory); submissions are refused from 90% of it, as of any Redis's maxmemory",
        lo=0,
    ),
    Option(
        "main_server_minio_address",
        str,
        "127.0.0.1:9000",
        "MinIO/S3 endpoint HOST:PORT",
        check=parse_host_port,
    ),
    Option("main_server_minio_access_key_id", str, "", "S3 access key id", secret=True),
    Option("main_server_minio_secret_access_key", str, "", "S3 secret key", secret=True),
    Option("main_server_minio_bucket", str, "gpupool", "bucket for datasets and artifacts"),
    Option(
        "main_server_minio_bucket_ping_timeout",
        float,
        30.0,
        "seconds the server or a worker waits for the bucket at start",
        lo=0,
    ),
    Option("local_minio_port", int, 9000, "port of a MinIO the server machine runs", lo=1, hi=65535),
    Option(
        "worker_local_processors",
        int,
        -1,
        "slots the server runs itself in singlenode mode; -1: one per GPU of the machine, or one per "
        "CPU it may run on (its affinity) on a machine without GPUs",
        lo=-1,
        hi=4096,
    ),
    Option("worker_remote_processors", int, 2, "slots per worker", lo=1, hi=4096),
    Option(
        "worker_cache_bytes",
        int,
        50 * 1024**3,
        "bytes of datasets a worker keeps in its content-addressed cache (LRU-evicted beyond)",
        lo=0,
    ),
    Option(
        "worker_env_cache_bytes",
        int,
        20 * 1024**3,
        "bytes of Python environments a worker keeps, built from jobs' lock files (worker/envs.py); "
        "the least recently used beyond are evicted, never one a running job uses",
        lo=0,
    ),
    Option(
        "worker_env_index_url",
        str,
        "",
        "the package index uv builds jobs' environments from (empty: PyPI; none: no index, "
        "worker_env_find_links only); may hold credentials, which jobs never see",
        secret=True,
    ),
    Option(
        "worker_env_extra_index_urls",
        list,
        [],
        "more package indexes for jobs' environments (credentials never reach jobs)",
        secret=True,
    ),
    Option("worker_env_find_links", list, [], "directories or URLs of wheels for jobs' environments"),
    Option(
        "worker_env_python_downloads",
        bool,
        False,
        "let uv download a Python that a job's lock needs and the worker lacks (off: such a job "
        "fails, saying so)",
    ),
    Option(
        "worker_env_allow_source_builds",
        bool,
        False,
        "let uv build packages from source for jobs' environments, which runs their code as the "
        "builder's uid (off: binary wheels only)",
    ),
    Option(
        "worker_reserved_mem",
        int,
        2 * 2**30,
        "bytes of the machine's memory a worker keeps for the system and itself: its jobs' --mem "
        "is fitted into the rest",
        lo=0,
    ),
    Option(
        "gpu_max_jobs",
        int,
        4,
        "the most pool jobs that may share one GPU (poolctl enqueue --gpu-mem), each within the "
        "memory it declared; a GPU shared is never handed out whole",
        lo=1,
    ),
    Option(
        "gpu_health_policy",
        str,
        "requeue",
        "what a worker does with the job on a GPU a health fault quarantines (Xid, uncorrectable "
        "ECC, pages pending, off the bus, hardware slowdown): requeue, stop it and hand it back to "
        "run on a sound GPU; let_finish, let it run to its end",
        choices=("requeue", "let_finish"),
    ),
    Option(
        "gpu_health_clear",
        float,
        600.0,
        "seconds without a health fault after which a quarantined GPU is checked (NVML answers, "
        "its memory readable) and, passing, back in use",
        lo=0,
    ),
    Option(
        "idle_gpu_util",
        float,
        5.0,
        "percent: a job whose every GPU reads below it is leaving its GPUs idle",
        lo=0,
        hi=100,
    ),
    Option(
        "idle_gpu_minutes",
        float,
        30.0,
        "minutes a job may leave its GPUs idle before it is flagged (its log, poolctl show, the "
        "dashboard, its notification); 0: never flagged",
        lo=0,
    ),
    Option(
        "idle_gpu_grace_minutes",
        float,
        30.0,
        "minutes more of idle GPUs, after the flag, before the queues below act",
        lo=0,
    ),
    Option(
        "idle_gpu_requeue_queues",
        list,
        [],
        "queues whose jobs left idle past the flag and its grace go back to the front of the queue",
    ),
    Option(
        "idle_gpu_cancel_queues",
        list,
        [],
        "queues whose jobs left idle past the flag and its grace are cancelled",
    ),
    Option(
        "fast_path",
        bool,
        True,
        "the fast path for short jobs on workers without GPUs: claims ahead of a free slot, an "
        "idle worker's claim sent with the next enqueue, outcomes batched (off: each claim for a "
        "free slot, each call by itself; what is decided is the same)",
    ),
    Option(
        "worker_healthy_response_period",
        float,
        300.0,
        "seconds of heartbeat silence after which a worker is dead and its jobs reclaimed",
        lo=1,
    ),
    Option(
        "redis_events_block_ms",
        float,
        1000.0,
        "ms one blocking read of job results (XREAD BLOCK) waits: a result in a queue the server "
        "knows is seen at once; one in a queue new to it, within this time",
        lo=1,
        hi=60_000,
    ),
    Option(
        "heartbeat_interval",
        float,
        0.0,
        "seconds between heartbeats; 0 means a tenth of worker_healthy_response_period",
        lo=0,
    ),
    Option(
        "job_uid_range",
        str,
        "",
        "FIRST-LAST: uids (and gids) of no real user, one per slot, that a root worker runs its jobs "
        "as (empty: a root worker leases free uids from 62000 on, and one that is not root runs "
        'jobs as its own user; "root": jobs run as root, by your explicit choice)',
        check=job_uid_range_of,
    ),
    Option(
        "job_network",
        str,
        "host",
        "host: jobs share the machine's network (and reach each other's loopback ports and "
        "abstract unix sockets); private: each job with a uid of its own gets a network of its "
        "own with only loopback, no route out (jobs that download need host)",
        choices=("host", "private"),
    ),
    Option(
        "drain_timeout",
        float,
        60.0,
        "seconds a stopping worker lets running jobs finish before it stops them and hands them back",
        lo=0,
    ),
    Option(
        "kill_grace",
        float,
        10.0,
        "seconds between SIGTERM and SIGKILL when a job is stopped (cancel, timeout, drain)",
        lo=0,
    ),
    Option(
        "shell_idle_limit",
        float,
        3600.0,
        "seconds a shell (`poolctl shell`) may go without input from its user, attached or not, "
        "before it is stopped and its GPUs freed (`poolctl shell --idle` sets a shell's own, up to this)",
        lo=1,
    ),
    Option("worker_idle_exit", float, 0.0, "seconds a worker idle (no job held) waits, then leaves", lo=0),
    Option("worker_max_lifetime", float, 0.0, "seconds after its start by which a worker has left", lo=0),
    Option(
        "worker_serve_user",
        str,
        "",
        "the one pool user whose jobs this worker runs (empty: every user's); a worker that does "
        "not run as root runs every job as itself, so it must name one",
    ),
    Option(
        "worker_via_server",
        str,
        "",
        "HOST:PORT of the pool server through which this worker takes its jobs, as an agent "
        "(empty: it speaks to Redis and the store itself): it then holds no Redis or S3 "
        "credential, only worker_token_file's token, and acts as worker_serve_user",
    ),
    Option(
        "worker_token_file",
        str,
        "",
        "file (this worker's own, mode 600) holding worker_serve_user's token, with which an agent "
        "worker (worker_via_server) signs in to the pool server",
    ),
    Option(
        "job_nice",
        int,
        5,
        "how much nicer than the worker its jobs run (0-19): the pool's own work (heartbeats, "
        "claims, Redis) is never starved by the jobs it runs",
        lo=0,
        hi=19,
    ),
    Option("job_retention", float, 7 * 24 * 3600.0, "seconds finished jobs are kept", lo=60),
    Option(
        "accounting_retention_days",
        int,
        400,
        "days each ended job's accounting record (`poolctl acct`: about 40 bytes) is kept, past "
        "its job's own record; the workers' and the server's value counts for the jobs each ends",
        lo=1,
        hi=100 * 366,
    ),
    Option(
        "retry_backoff",
        float,
        10.0,
        "seconds a failed job with --retries left waits before it goes back to the front of its "
        "queue, doubled for each failure (0: at once); the workers' value counts",
        lo=0,
    ),
    Option(
        "retry_backoff_max",
        float,
        600.0,
        "the longest retry_backoff grows to",
        lo=0,
    ),
    Option(
        "job_log_max_bytes",
        int,
        16 * 2**20,
        "bytes of output a job's log keeps: its first quarter, then the newest (a line marks the gap)",
        lo=64 * 1024,
    ),
    Option(
        "dead_worker_retention",
        float,
        24 * 3600.0,
        "seconds a worker that stopped beating (crashed) stays listed, as dead, before it is forgotten",
        lo=60,
    ),
    Option("queues", list, ["default"], "queues a worker serves, in priority order"),
    Option(
        "user_max_running_jobs",
        int,
        0,
        "the most jobs one user may run at once in one queue (0: no cap); their other jobs wait, "
        "keeping their place, while the jobs of others behind them start",
        lo=0,
        hi=100000,
    ),
    Option(
        "user_max_gpus",
        int,
        0,
        "the most GPUs one user's running jobs may hold in one queue (0: no cap); a user with "
        "nothing running may always start one job",
        lo=0,
        hi=100000,
    ),
    Option(
        "user_max_queued_jobs",
        int,
        100_000,
        "the most jobs one user may have queued or running in one queue (0: no bound); more are "
        "refused, saying so, until some end",
        lo=0,
        hi=10**9,
    ),
    Option(
        "user_max_stored_bytes",
        int,
        2**30,
        "bytes of jobs one user may submit, over every queue, within one job_retention (their specs "
        "and about 6 KiB a record; a job's record is kept that long after it ends, cancelled or not) "
        "(0: no bound); more are refused, saying when room comes back",
        lo=0,
    ),
    Option(
        "job_spec_max_bytes",
        int,
        64 * 1024,
        "bytes of one job's spec (its command, environment, name and the rest, encoded) the server "
        "takes; a larger one is refused, saying so",
        lo=4096,
        hi=8 * 2**20,
    ),
    Option(
        "project_max_bytes",
        int,
        512 * 2**20,
        "bytes of the project a job runs in (the files poolctl sends from the directory it runs "
        "in); a larger one is refused, naming its biggest files: data goes with `poolctl put` "
        "(at most 1 GiB: a job's spec names each of its packs, 4 MiB at least)",
        lo=0,
        hi=2**30,
    ),
    Option(
        "job_name_max_chars",
        int,
        256,
        "characters of one job's name the server takes; a longer one is refused, saying so",
        lo=16,
        hi=65536,
    ),
    Option(
        "queue_default_cpus",
        list,
        [],
        "QUEUE=N: the CPUs a job of that queue gets when it asks for none (--cpus); the server "
        "fills it in at enqueue",
        check=queue_cpus,
    ),
    Option(
        "queue_default_mem",
        list,
        [],
        "QUEUE=BYTES (e.g. gpu=34359738368): the memory a job of that queue gets when it asks for "
        "none (--mem); the server fills it in at enqueue",
        check=queue_mem,
    ),
    Option(
        "fairshare_queues",
        list,
        [],
        "queues whose next start goes to the user with the least recent use (GPU-seconds, decayed; "
        "fairshare_weight in the tokens file divides it) rather than to the oldest job",
    ),
    Option(
        "fairshare_half_life",
        float,
        7 * 24 * 3600.0,
        "seconds after which a user's recent use counts half in a fair-share queue",
        lo=1,
    ),
    Option(
        "preempt_queues",
        list,
        [],
        "queues where a job with a --priority that must wait for GPUs stops running jobs of lower "
        "priority on the worker it reserved, which go back to the front of the queue (checkpoints kept)",
    ),
    Option(
        "default_max_priority",
        int,
        0,
        "the highest --priority a user may give a job when the tokens file gives them no "
        "max_priority (admins: any; a singlenode pool sets no ceiling)",
        lo=0,
        hi=100,
    ),
    Option(
        "data_dir",
        str,
        "",
        "where the embedded Redis, the local store and state live "
        "(default: $STATE_DIRECTORY under systemd, else $XDG_DATA_HOME/gpupool, else "
        "/var/lib/gpupool for root and ~/.local/share/gpupool for others)",
    ),
    Option(
        "listen", str, f"127.0.0.1:{SERVER_PORT}", "HOST:PORT of the wire protocol", check=parse_host_port
    ),
    Option(
        "metrics_listen",
        str,
        "",
        "HOST:PORT of the Prometheus metrics (default: 127.0.0.1:"
        f"{SERVER_METRICS_PORT} for the server, {WORKER_METRICS_PORT} for a worker)",
        check=parse_host_port,
    ),
    Option(
        "web_listen",
        str,
        f"127.0.0.1:{WEB_PORT}",
        "HOST:PORT of the web dashboard (server mode; off: none)",
        check=lambda v: v == "off" or parse_host_port(v),
    ),
    Option("web_hosts", list, [], "more Host names the dashboard answers to", check=check_host_names),
    Option("max_connections", int, 1000, "client connections the server accepts at once", lo=1, hi=1_000_000),
    Option(
        "max_connections_per_user",
        int,
        64,
        "authenticated connections one user may hold at once",
        lo=1,
        hi=1_000_000,
    ),
    Option(
        "max_frame_size",
        int,
        16 * 1024 * 1024,
        "largest protocol frame payload (bytes) the server accepts",
        lo=4096,
        hi=1024**3,
    ),
    Option("handshake_timeout", float, 10.0, "seconds a client has to authenticate after connecting", lo=0.1),
    Option("idle_timeout", float, 300.0, "seconds an idle client connection stays open", lo=0.1),
    Option("tokens_file", str, "", 'file of `user = "token"` lines (mode 0600) the server accepts'),
    Option(
        "tls",
        str,
        "auto",
        "auto: TLS on a listener beyond loopback (with tls_cert/tls_key, or a certificate the server "
        "makes once and poolctl pins); on: always; off: never (e.g. behind a TLS proxy)",
        choices=("auto", "on", "off"),
    ),
    Option("tls_cert", str, "", "server TLS certificate (PEM); with tls_key, enables TLS"),
    Option("tls_key", str, "", "server TLS private key (PEM)", secret=False),
    Option("notify_url", str, "", "http(s) URL the server POSTs every job's end to", check=check_url),
    Option("notify_secret", str, "", "key of the signature of what goes to notify_url", secret=True),
    Option(
        "notify_allow",
        list,
        [],
        "networks (CIDR) and host names users' --notify hooks may reach besides public addresses "
        "(loopback, private, link-local and the like are refused unless listed)",
        check=Allowed.parse,
    ),
    Option(
        "notify_timeout",
        float,
        10.0,
        "seconds a notification's receiver has to answer one POST (a server's hold on a delivery "
        "lasts 6 times this: one killed mid-delivery leaves it to another server after that long)",
        lo=0.1,
        hi=600.0,
    ),
    Option("log_format", str, "text", "text or json (one JSON object per line)", choices=("text", "json")),
    Option(
        "log_level",
        str,
        "info",
        "debug, info, warning or error",
        choices=("debug", "info", "warning", "error"),
    ),
)
BY_NAME = {o.name: o for o in OPTIONS}
# Old names still read, with a warning at start-up (Config.renamed), until a release says otherwise.
RENAMED = {"redis_result_queue_polling_interval": "redis_events_block_ms"}
SECRET_NAMES = frozenset(o.name for o in OPTIONS if o.secret)
