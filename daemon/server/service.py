"""Server mode: the pool's Redis, the reaper, terminal events, and the client listener."""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from daemon import pools, sd_notify, tokens
from daemon.address import fits_unix_socket, is_loopback, parse_host_port
from daemon.aio import TaskSet, start_or_undo
from daemon.config import Config, make_data_dir
from daemon.errors import GpupoolError
from daemon.job import JobState, queue_of
from daemon.metrics.endpoint import MetricsServer, serve_for
from daemon.metrics.server import ServerMetrics
from daemon.object_store import make_store, open_checked
from daemon.queue import registry
from daemon.queue.job_queue import JobQueue
from daemon.queue.pool_redis import PoolRedis
from daemon.queue.terminal_events import JobEvents, Terminal
from daemon.server import reaper
from daemon.server.agents import Agents, AgentWorkerFactory
from daemon.server.bounds import SubmitBounds
from daemon.server.certificate import certificate_fingerprint, ensure_certificate
from daemon.server.data_desk import prune_staged_forever
from daemon.server.dependencies import Dependencies
from daemon.server.handlers import Handlers
from daemon.server.listener import Listener, ListenerError, refuse_open_beyond_loopback, tls_context
from daemon.server.notifier import Notifier
from daemon.server.queue_defaults import QueueDefaults
from daemon.server.session import Limits
from daemon.server.web.app import WebServer
from daemon.server.web.snapshot import Snapshots
from daemon.spec_checks import PRIORITY_MAX
from daemon.webhook_targets import Allowed
from storage.base import ObjectStore

log = logging.getLogger(__name__)


class LocalSlots(Protocol):
    """The job slots a single-machine pool runs itself: a worker, which main.py hands the server
    (server/ never imports worker code)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def force(self) -> None: ...


# Builds the local slots on the server's queue, configuration and object store.
LocalSlotsFactory = Callable[[JobQueue, Config, ObjectStore], LocalSlots]


class LocalSlotsError(GpupoolError):
    """The local slots would hand one user's jobs the pool's credentials; the sentence says what
    to set."""


def refuse_shared_local_slots(config: Config, users: int) -> None:
    """Refuse local slots that would run the jobs of `users` pool users, more than one, as the
    server's own user, which it is when it is not root: any job could read the server's data
    directory (every user's token, the embedded Redis's password, the stored data). A pool of one
    user (a workstation's: only the token the server makes for its local user) is that user's own;
    with more, `worker_serve_user` gives the slots one of them, as it gives a worker that is not
    root (worker/non_root.py)."""
    if os.geteuid() == 0 or config.worker_serve_user or users <= 1:
        return
    raise LocalSlotsError(
        f"this server does not run as root, so its local slots would run the jobs of all {users} "
        "users of its tokens file as its own user, and any job could read its data directory "
        "(every user's token, the Redis password, the stored data): set worker_serve_user "
        "(--worker-serve-user USER, GPUPOOL_WORKER_SERVE_USER) to the one user whose jobs the local "
        "slots may run, who may then read all the server's user may (its owner), or set "
        "worker_local_processors = 0 and run workers as root, or run the server as root"
    )


class PoolServer:
    """`start()` brings the pool up; `stop()` takes it down in reverse order and is safe to call twice."""

    def __init__(
        self,
        config: Config,
        local_slots: LocalSlotsFactory | None = None,
        agent_workers: AgentWorkerFactory | None = None,
    ) -> None:
        """`local_slots` builds the slots an embedded pool runs itself (`worker_local_processors`
        of them; none without it); `agent_workers` the worker the server runs for each agent that
        offers its machine (server/agents.py; without it, serve_jobs is refused)."""
        self.config = config
        self._local_slots = local_slots
        self._agent_workers = agent_workers
        self.agents: Agents | None = None  # at start: the agents' workers
        self.redis = PoolRedis(config)
        self.queue: JobQueue | None = None
        self.listener: Listener | None = None
        self.web: WebServer | None = None  # the dashboard (web_listen)
        self.metrics = ServerMetrics()
        self.metrics_server: MetricsServer | None = None
        self.local: LocalSlots | None = None  # the slots a single-machine pool runs itself
        self.store = make_store(config)  # opened at start; presigns and records, carries no bytes
        self.own_certificate: str | None = None  # the fingerprint of the certificate it made itself
        self._tasks = TaskSet()
        self.dependencies: Dependencies | None = None  # at start: jobs that wait for others
        self.notifier: Notifier | None = None  # at start: --notify and notify_url
        # At start: each user's token (None: an open pool), the listener's and the dashboard's,
        # which a reload changes in place.
        self.known_tokens: dict[str, bytes] | None = None
        self.handlers: Handlers | None = None

    def _users(self, config: Config | None = None) -> tokens.Users | None:
        c = self.config if config is None else config
        if c.tokens_file:
            return tokens.read_users(Path(c.tokens_file))
        if c.embedded:  # a single-machine pool authenticates its local user with no set-up
            return tokens.read_users(tokens.ensure_local_token(c.data_path()))
        return None  # open mode; Listener allows it on loopback only

    def _local_socket(self) -> Path | None:
        """A single-machine pool's Unix socket, beside its data (poolctl here connects through
        it: no TCP stack on the way to a job's start); None in
        a pool of several machines, or where the path is too long for a socket."""
        path = self.config.data_path() / "pool.sock"
        return path if self.config.embedded and fits_unix_socket(path) else None

    def _tls(self, address: str, *, protocol: bool = True) -> ssl.SSLContext | None:
        """TLS for the listener on `address` as `tls` says: with the configured certificate, else
        with the server's own (made once, its fingerprint logged for users to compare with what
        poolctl pins). Only the protocol's listener (`protocol`) sets what poolctl pins: the
        dashboard may speak TLS where the protocol, on loopback, does not."""
        c = self.config
        host = parse_host_port(address)[0]
        if c.tls == "off":
            if not is_loopback(host):
                log.warning("tls = off: requests to %s cross the network in clear", address)
            return None
        if c.tls_cert:
            return tls_context(c.tls_cert, c.tls_key)
        if c.tls == "auto" and is_loopback(host):
            return None
        cert, key = ensure_certificate(c.data_path() / "tls", host)
        fingerprint = certificate_fingerprint(cert)
        if protocol:
            self.own_certificate = fingerprint
        note = "poolctl pins it on first use" if protocol else "the dashboard's"
        log.info("TLS certificate %s, fingerprint %s (%s)", cert, fingerprint, note)
        return tls_context(str(cert), str(key))

    async def start(self) -> None:
        """Start everything; a failed start stops what did start (aio.start_or_undo)."""
        await start_or_undo(self._start, self.stop)

    async def _start(self) -> None:
        c = self.config
        if bool(c.tls_cert) != bool(c.tls_key):
            raise ListenerError("tls_cert and tls_key go together: give both, or neither")
        if c.embedded:  # before anything is written in it (the local token, Redis, the store)
            make_data_dir(c.data_path())
        users = self._users()
        self.known_tokens = known_tokens = dict(users.tokens) if users is not None else None
        if c.embedded and c.worker_local_processors != 0 and self._local_slots is not None:
            refuse_shared_local_slots(c, len(known_tokens or ()))  # before starting anything
        host, port = c.listen_address()
        refuse_open_beyond_loopback(known_tokens, host, port)  # before starting anything
        await open_checked(self.store, c, "server")  # S3: its bucket, or no server
        client = await self.redis.start()
        self.queue = JobQueue.from_config(client, c, watch=self.redis.watch)
        if c.fairshare_queues:
            await self.queue.set_fairshare_weights(dict(users.weights) if users is not None else {})
        # Results are read by a blocking read, seen at once; the queue set is read again after each
        # read that timed out (a result in a queue new to this server is seen within that).
        events = JobEvents(self.queue, c.redis_events_block_ms / 1000, self._finished)
        await events.prime()  # before the listener: a `wait` must not start before its cursors
        self._tasks.spawn(events.run(), "job-events")
        reap_every = min(c.worker_healthy_response_period / 4, 5.0)
        # After the events: no end is missed between; swept as often as leases are reaped.
        self.dependencies = Dependencies(self.queue, sweep_every=reap_every)
        self._tasks.spawn(self.dependencies.run(), "dependencies")
        self.notifier = Notifier(
            self.queue,
            self.metrics,
            pool_url=c.notify_url,
            secret=c.notify_secret,
            allowed=Allowed.parse(c.notify_allow),
            user_tokens=users.tokens if users is not None else None,
            timeout=c.notify_timeout,
        )
        await self.notifier.start()  # its own tasks: stopped after the events reader that feeds it
        self._tasks.spawn(
            reaper.run(self.queue, reap_every, self._reclaimed, c.dead_worker_retention), "reaper"
        )
        self._tasks.spawn(prune_staged_forever(self.store), "staged-upload prune")
        self.handlers = handlers = self._handlers(self.queue, events, users)
        self.listener = Listener(
            handlers,
            known_tokens,
            host,
            port,
            tls=self._tls(c.listen),
            limits=Limits(
                max_frame_size=c.max_frame_size,
                handshake_timeout=c.handshake_timeout,
                idle_timeout=c.idle_timeout,
                max_connections=c.max_connections,
                max_connections_per_user=c.max_connections_per_user,
            ),
            metrics=self.metrics,
            socket=self._local_socket(),
        )
        await self.listener.start()
        if c.web_listen != "off":
            web_host, web_port = parse_host_port(c.web_listen)
            self.web = WebServer(
                handlers,
                Snapshots(self.queue, self.list_workers),
                known_tokens,
                web_host,
                web_port,
                tls=self._tls(c.web_listen, protocol=False),
                extra_hosts=c.web_hosts,
                throttle=self.listener.throttle,
            )
            await self.web.start()
        self.metrics.watch(self.queue, self.list_workers)
        self.metrics_server = await serve_for(
            self.metrics.registry, c, worker=False, before_scrape=self.metrics.refresh
        )
        if c.embedded and c.worker_local_processors != 0 and self._local_slots is not None:
            local = self._local_slots(self.queue, c, self.store)
            await local.start()  # leaves nothing running if it fails
            self.local = local
        if c.embedded:  # poolctl on this machine finds it with no set-up: pools.toml's "local"
            try:  # or a name of its own, when another single-machine pool runs there
                token_file = tokens.client_dir() / "token"
                log.info(pools.register_local(self.listener.local_address, token_file, self.own_certificate))
            except pools.PoolsError as exc:
                log.warning("%s; poolctl here needs --server %s", exc, self.listener.local_address)
        where = f"embedded, data in {c.data_path()}" if self.redis.embedded else c.worker_mode
        log.info(
            "gpupool server ready on %s%s: Redis on %s (%s), metrics on %s:%d, dashboard %s",
            self.listener.address,
            f" and {self.listener.socket}" if self.listener.socket is not None else "",
            self.redis.address,
            where,
            self.metrics_server.host,
            self.metrics_server.port,
            f"on {self.web.address}" if self.web is not None else "off",
        )
        if (interval := sd_notify.watchdog_interval()) is not None:
            self._tasks.spawn(sd_notify.watchdog(interval), "watchdog")
        sd_notify.ready(f"serving on {self.listener.address}")

    def _handlers(self, queue: JobQueue, events: JobEvents, users: tokens.Users | None) -> Handlers:
        """What the server does for each request, the agents' workers' requests among them."""
        c = self.config
        admins = users.admins if users is not None else frozenset()
        self.agents = Agents(self._agent_workers, queue, c, self.store, admins)
        handlers = Handlers(
            queue,
            events,
            self.list_workers,
            self.metrics,
            self.store,
            admins=admins,
            notify_allowed=Allowed.parse(c.notify_allow),
            max_priority=dict(users.max_priority) if users is not None else None,
            default_max_priority=self._default_max_priority(c, users),
            bounds=SubmitBounds.of(c),
            agents=self.agents,
        )
        handlers.admission.defaults = QueueDefaults.of(c)
        return handlers

    @staticmethod
    def _default_max_priority(c: Config, users: tokens.Users | None) -> int:
        # a single machine's pool, and an open one (loopback only), set no ceiling
        return c.default_max_priority if users is not None and not c.embedded else PRIORITY_MAX

    async def reload(self, config: Config) -> list[str]:
        """SIGHUP (daemon/reload.py): read the tokens file again, and take `config`'s bounds on
        what a user may submit. Returns a sentence for each thing reloaded. A tokens file that does
        not read raises TokenError with nothing changed. A user removed, or given a new token, has
        every connection and dashboard session made with the old one ended at once."""
        if self.handlers is None or self.queue is None:
            return []
        said = []
        users = self._users(config) if self.known_tokens is not None else None
        if users is not None and self.local is not None:
            refuse_shared_local_slots(config, len(users.tokens))  # as at the start
        if users is not None and self.known_tokens is not None:
            if config.fairshare_queues:  # first: should Redis fail, nothing has changed yet
                await self.queue.set_fairshare_weights(dict(users.weights))
            before = self.known_tokens.copy()
            self.known_tokens.clear()  # in place: the listener and the dashboard read this map
            self.known_tokens.update(users.tokens)
            self.handlers.admission.admins = users.admins
            self.handlers.admission.max_priority = dict(users.max_priority)
            if self.agents is not None:
                self.agents.admins = users.admins
            path = config.tokens_file or str(config.data_path() / "tokens.toml")
            said.append(_tokens_change(path, before, users))
            taken_back = {u for u, token in before.items() if users.tokens.get(u) != token}
            if taken_back and self.listener is not None:  # no connection outlives its token
                self.listener.cut_off(taken_back)
            if taken_back and self.web is not None:
                self.web.sessions.sign_out(taken_back)
        self.handlers.admission.bounds = SubmitBounds.of(config)
        self.handlers.admission.defaults = QueueDefaults.of(config)
        self.handlers.admission.default_max_priority = self._default_max_priority(config, users)
        self.queue.max_unended = config.user_max_queued_jobs
        self.queue.max_stored = config.user_max_stored_bytes
        self.config = config
        return said

    def _finished(self, event: Terminal) -> None:
        if self.dependencies is not None:
            self.dependencies.ended(event.job_id)
        if self.notifier is not None:
            self.notifier.ended(event)
        wait = run = None
        if event.started_at is not None:
            wait = event.started_at - (event.enqueued_at or event.started_at)
            run = (event.ended_at or event.started_at) - event.started_at
        self.metrics.job_finished(event.queue, event.state, wait, run)

    def _reclaimed(self, job_id: str, state: JobState) -> None:
        self.metrics.attempts_reclaimed(queue_of(job_id))

    async def list_workers(self) -> list[dict[str, Any]]:
        assert self.queue is not None
        return await registry.list_workers(self.queue.redis)

    def force(self) -> None:
        """A second stop signal: local and agents' jobs are stopped and handed back now, not drained."""
        if self.local is not None:
            self.local.force()
        if self.agents is not None:
            self.agents.force()

    async def stop(self) -> None:
        """Drain the local slots and the agents' workers (while the listener still carries the
        agents' streams: bounded, agents.py), close the metrics and the listener, stop the
        background tasks, then Redis. Safe to call twice."""
        sd_notify.stopping("stopping")
        if self.agents is not None:
            await self.agents.stop()
        if self.local is not None:
            await self.local.stop()
            self.local = None
        if self.metrics_server is not None:
            await self.metrics_server.close()
            self.metrics_server = None
        if self.web is not None:
            await self.web.stop()
            self.web = None
        if self.listener is not None:
            await self.listener.stop()
            self.listener = None
        await self._tasks.stop()
        if self.notifier is not None:  # before Redis: it hands back what it did not deliver
            await self.notifier.stop()
            self.notifier = None
        await self.redis.stop()
        await self.store.close()
        log.info("gpupool server stopped")


def _tokens_change(path: str, before: dict[str, bytes], users: tokens.Users) -> str:
    """What a reload of the tokens file changed, in one sentence."""
    now = users.tokens
    added = sorted(set(now) - set(before))
    removed = sorted(set(before) - set(now))
    new_token = sorted(u for u in set(now) & set(before) if now[u] != before[u])
    parts = [
        f"{what} {', '.join(names)}"
        for what, names in (("added", added), ("removed", removed), ("new token for", new_token))
        if names
    ]
    admins = f", {len(users.admins)} admins" if users.admins else ""
    return f"tokens file {path}: {len(now)} users{admins} ({'; '.join(parts) or 'no user added or removed'})"
