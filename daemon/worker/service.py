"""Worker mode as a daemon (`poold --worker`): the pool's Redis, the object store, one Worker, its
metrics endpoint, readiness and the systemd watchdog; and its end, for a worker that leaves by
itself (lifetime.py: idle, or at its lifetime's end, as a pilot worker on a batch cluster does).
With `worker_via_server`, an Agent instead (agent.py), which holds no Redis or S3 credential: its
token is read from `worker_token_file`, which must be its own and closed to others."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from pathlib import Path

from daemon import sd_notify
from daemon.aio import TaskSet, start_or_undo
from daemon.client.pool_client import PoolClient
from daemon.config import Config, make_data_dir
from daemon.errors import GpupoolError
from daemon.git import ANY_PROTOCOL, NETWORK_PROTOCOLS
from daemon.metrics.endpoint import MetricsServer, serve_for
from daemon.object_store import open_worker_store
from daemon.queue.job_queue import JobQueue
from daemon.queue.pool_redis import PoolRedis
from daemon.tokens import refuse_open
from daemon.worker import gpus, non_root
from daemon.worker.agent import Agent, AgentError
from daemon.worker.dispatcher import Worker
from daemon.worker.env_build import EnvSettings
from daemon.worker.host import HostResources, machine_cpus
from daemon.worker.identity import SlotIdentity, lease_uids, slot_identities
from daemon.worker.idle_gpus import IdlePolicy
from daemon.worker.lifetime import Lifetime
from storage.base import ObjectStore

log = logging.getLogger(__name__)


class WorkerDaemon:
    """Worker mode (`poold --worker`): the pool's Redis, the object store, a Worker, its metrics,
    readiness and watchdog. `main` drives it like the server: `start()`, then on the first signal
    `stop()` (drain), on a second `force()` (stop jobs now; attempts are still handed back).
    `leaving` is set when the worker's lifetime says it must leave: main then stops it as on the
    first signal (a signal after that is the second)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.leaving = asyncio.Event()
        # Read now, near the process's start: a bad worker_max_lifetime stops poold before it connects.
        self.lifetime = Lifetime.of(config)
        self.redis = PoolRedis(config)
        self.worker: Worker | None = None
        self.store: ObjectStore | None = None
        self.metrics_server: MetricsServer | None = None
        self._tasks = TaskSet()

    async def start(self) -> None:
        """Start everything; a failed start stops what did start (aio.start_or_undo)."""
        await start_or_undo(self._start, self.stop)

    async def _start(self) -> None:
        c = self.config
        if c.embedded:
            raise GpupoolError(
                "worker mode needs worker_mode = multinode and the pool's Redis (redis_ip, redis_port, "
                "main_server_redis_password); in singlenode mode the server runs its own slots"
            )
        # A worker not running as root runs every job as itself (non_root.py): one user's only,
        # its data closed to others.
        non_root.check_serve_user(c)
        await asyncio.to_thread(make_data_dir, c.data_path())
        non_root.check_data_dir(c.data_path())
        client = await self.redis.start()
        queue = JobQueue.from_config(client, c, watch=self.redis.watch)
        self.store = await open_worker_store(c)
        self.worker = configured_worker(queue, c, store=self.store, lifetime=self.lifetime)
        await self.worker.start()
        if self.lifetime is not None:
            self._tasks.spawn(self._leave_when_due(self.lifetime, self.worker), "lifetime")
        self.metrics_server = await serve_for(
            self.worker.metrics.registry, c, worker=True, before_scrape=self.worker.sample_metrics
        )
        if (interval := sd_notify.watchdog_interval()) is not None:
            self._tasks.spawn(sd_notify.watchdog(interval), "watchdog")
        w = self.worker
        sd_notify.ready(f"worker {w.id}: {w.slots} slots, queues {', '.join(w.queues)}")

    async def _leave_when_due(self, lifetime: Lifetime, worker: Worker) -> None:
        why = await lifetime.due(worker.idle_for)
        if not self.leaving.is_set():  # not stopping on a signal already (main shares the event)
            log.info("worker %s leaving: %s", worker.id, why)
            self.leaving.set()

    def force(self) -> None:
        if self.worker is not None:
            self.worker.force()

    async def stop(self) -> None:
        """Drain the worker, then close what start() opened, in reverse order. Safe to call twice."""
        if self.worker is not None:
            sd_notify.stopping(f"draining {len(self.worker.running)} running jobs")
            await self.worker.stop()
            self.worker = None
        if self.metrics_server is not None:
            await self.metrics_server.close()
            self.metrics_server = None
        await self._tasks.stop()
        if self.store is not None:
            await self.store.close()
            self.store = None
        await self.redis.stop()


def configured_worker(
    queue: JobQueue,
    config: Config,
    *,
    slots: int | None = None,
    data_dir: Path | None = None,
    store: ObjectStore | None = None,
    lifetime: Lifetime | None = None,
) -> Worker:
    """A worker with the configuration's queues, timings, cache size and (default) remote slot
    count, on `store` (opened by the caller), leaving by itself as `lifetime` says (None: never)."""
    n = config.worker_remote_processors if slots is None else slots
    identities = slot_identities(config.job_uid_range, n)
    if identities is not None and len(identities) < n:
        # Fewer slots, each safe, rather than no pool (an embedded pool has a slot per GPU or core by
        # default).
        log.warning(
            "job_uid_range = %s holds %d uids for %d slots: running %d slots (give it %d uids "
            "to run them all)",
            config.job_uid_range,
            len(identities),
            n,
            len(identities),
            n,
        )
        n = len(identities)
    elif identities is not None and not config.job_uid_range:
        log.info(
            "jobs run as %d uids from %d to %d, leased for this poold alone (set job_uid_range to "
            "choose them)",
            len(identities),
            identities[0].uid,
            identities[-1].uid,
        )
    return Worker(
        queue,
        data_dir=data_dir or config.data_path() / "worker",
        slots=n,
        queues=config.queues,
        heartbeat_seconds=config.heartbeat_seconds,
        drain_timeout=config.drain_timeout,
        kill_grace=config.kill_grace,
        shell_idle_limit=config.shell_idle_limit,
        job_nice=config.job_nice,
        job_network=config.job_network,
        store=store,
        cache_bytes=config.worker_cache_bytes,
        identities=identities,
        # A worker of a shared pool never clones a path of its own disk for a job (its mirrors
        # of other users' repositories, anything of root's): network protocols only.
        git_protocols=ANY_PROTOCOL if config.embedded else NETWORK_PROTOCOLS,
        gpu_max_jobs=config.gpu_max_jobs,
        gpu_health_policy=config.gpu_health_policy,
        gpu_health_clear=config.gpu_health_clear,
        lifetime=lifetime,
        idle_gpus=IdlePolicy.of(config),
        env_settings=env_settings(config),
        env_builder=env_builder(identities),
        host=HostResources.of_machine(config.worker_reserved_mem),
    )


def env_settings(config: Config) -> EnvSettings:
    """How a worker (or an agent) builds its jobs' environments (worker/envs.py)."""
    return EnvSettings(
        budget_bytes=config.worker_env_cache_bytes,
        index_url=config.worker_env_index_url,
        extra_index_urls=tuple(config.worker_env_extra_index_urls),
        find_links=tuple(config.worker_env_find_links),
        python_downloads=config.worker_env_python_downloads,
        source_builds=config.worker_env_allow_source_builds,
    )


def env_builder(identities: list[SlotIdentity] | None) -> SlotIdentity | None:
    """Who builds the environments: a uid of their own where jobs have theirs (a source build
    runs a package's code, which must reach neither the worker nor a job); else the worker's."""
    if identities is None:
        return None
    uid = lease_uids(1)[0]
    return SlotIdentity(uid, uid)


def local_slots(queue: JobQueue, config: Config, store: ObjectStore) -> Worker:
    """The slots a single-machine pool's server runs itself (`worker_local_processors`)."""
    return configured_worker(queue, config, slots=local_slot_count(config), store=store)


def local_slot_count(config: Config) -> int:
    """`worker_local_processors`, or for -1 (its default) what the machine can run at once: a job
    on each of its GPUs, or on each CPU it may run on (its affinity) where it has none."""
    if config.worker_local_processors >= 0:
        return config.worker_local_processors
    return gpus.count() or machine_cpus()


# -- through the server: an agent ------------------------------------------------------------


def read_token(path_text: str) -> str:
    """The agent's token from `path_text` (worker_token_file): a regular file of this uid's, closed to
    everyone else (mode 0600 or stricter), and not empty; AgentError saying what to fix otherwise.
    Another user's file, or one others may read, is refused: the token lets anyone who has it
    act as the pool user."""
    path = Path(path_text).expanduser()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise AgentError(
            f"worker_token_file {path} does not exist: put the pool user's token there (mode 600)"
        ) from None
    except OSError as exc:
        raise AgentError(
            f"cannot read worker_token_file {path} ({exc.strerror}): it must be a plain file, this "
            "agent's own"
        ) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise AgentError(
                f"worker_token_file {path} is not a plain file: give the file that holds the token"
            )
        if st.st_uid != os.geteuid():
            raise AgentError(
                f"worker_token_file {path} belongs to uid {st.st_uid}, not to this agent's (uid "
                f"{os.geteuid()}): the token must be the agent's own file, mode 600"
            )
        refuse_open(path, st.st_mode, ", the agent's worker_token_file,")
        token = f.read().decode(errors="replace").strip()
    if not token:
        raise AgentError(f"worker_token_file {path} is empty: put the pool user's token there")
    return token


class AgentDaemon:
    """Worker mode through the server (`poold --worker` with `worker_via_server`): an Agent, driven
    by main as a worker is: `start()`, `stop()` on the first signal, `force()` on a second, with
    readiness and the systemd watchdog. `leaving` is set when the agent must go by itself (its
    serve ended, or its lifetime is over)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        # Read now, near the process's start: a bad worker_max_lifetime stops poold before it connects.
        self.lifetime = Lifetime.of(config)
        self.agent: Agent | None = None
        self.leaving = asyncio.Event()
        self._tasks = TaskSet()

    async def start(self) -> None:
        """Start the agent; a failed start stops what did start (aio.start_or_undo)."""
        await start_or_undo(self._start, self.stop)

    async def _start(self) -> None:
        c = self.config
        token = read_token(c.worker_token_file)
        slots = c.worker_remote_processors
        identities = slot_identities(c.job_uid_range, slots)
        if identities is not None and len(identities) < slots:
            log.warning(
                "job_uid_range = %s holds %d uids for %d slots: running %d slots",
                c.job_uid_range,
                len(identities),
                slots,
                len(identities),
            )
            slots = len(identities)
        await asyncio.to_thread(make_data_dir, c.data_path())
        non_root.check_data_dir(c.data_path())
        self.agent = Agent(
            PoolClient(c.worker_via_server, c.worker_serve_user, token),
            data_dir=c.data_path() / "agent",
            slots=slots,
            queues=c.queues,
            drain_timeout=c.drain_timeout,
            kill_grace=c.kill_grace,
            job_nice=c.job_nice,
            job_network=c.job_network,
            identities=identities,
            cache_bytes=c.worker_cache_bytes,
            lifetime=self.lifetime,
            env_settings=env_settings(c),
            env_builder=env_builder(identities),
        )
        await self.agent.start()
        self._tasks.spawn(self._leave_when_told(self.agent), "agent leaving")
        if (interval := sd_notify.watchdog_interval()) is not None:
            self._tasks.spawn(sd_notify.watchdog(interval), "watchdog")
        a = self.agent
        sd_notify.ready(f"agent of worker {a.worker_id}: {a.slots} slots, queues {', '.join(a.queues)}")

    async def _leave_when_told(self, agent: Agent) -> None:
        await agent.leaving.wait()
        self.leaving.set()  # main stops it, as on a signal

    async def stop(self) -> None:
        """Stop the agent (its drain), then the rest. Safe to call twice."""
        if self.agent is not None:
            sd_notify.stopping(f"draining the agent of worker {self.agent.worker_id}")
            await self.agent.stop()
            self.agent = None
        await self._tasks.stop()

    def force(self) -> None:
        if self.agent is not None:
            self.agent.force()
