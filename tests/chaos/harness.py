"""The chaos harness: a real pool (redis-server, a `poold` server process, `poold --worker`
processes), real faults, and a ledger that every job writes to.

Each job is a tiny bash command that appends `job attempt attempt-id worker start|tick|end
microseconds` lines to the ledger (one short O_APPEND write per line, atomic between processes):
`start`, then a `tick` every TICK seconds while it runs, then `end`. A job killed before its end
leaves its last tick as the last sign it was alive. Most jobs run JOB_SECONDS; every SHORT_EVERY-th
is short (a start and an end, milliseconds), after which a worker claims jobs ahead of a free slot
(daemon/worker/fast_path.py); every LONG_EVERY-th runs LONG_SECONDS, longer than the two leases a
frozen worker stays frozen, so that its orphan guard has to kill it. Faults are real: SIGKILL and
SIGSTOP/SIGCONT of worker processes, kill -9 and restart of redis-server on its AOF, the same
restart from an older copy of the AOF (Redis loses its last writes), Redis at its maxmemory,
replies to one worker delayed by a proxy (stale replies), SIGTERM and restart of the server
process. Submissions use idempotency keys and retry across server restarts, as a careful client
would.

On a Sentinel group (tests/support/sentinel.py) instead of one redis-server, the Redis faults are
failovers: the primary SIGKILLed, a replica promoted, the dead node started again later as a
replica; every process finds the primary through the sentinels, and submits and outcomes are
acknowledged once on a replica (`redis_min_replicas_ack = 1`). On a Redis Cluster
(tests/support/cluster.py: three primaries, a replica each) they are a shard's primary SIGKILLed
(in turn the default queue's shard and the pool-wide keys' one), its replica taking over, and the
dead node started again at once as the new primary's replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from daemon.address import parse_host_ports
from daemon.client.pool_client import ClientError, PoolClient
from daemon.queue import keys, registry
from daemon.queue.connection import connect_sentinel
from daemon.queue.embedded_redis import EmbeddedRedis, free_port
from daemon.queue.job_queue import JobQueue
from protocol import Enqueue, Enqueued, Requeued, RequeueJobs
from protocol.errors import ErrorCode
from tests.support.cluster import ClusterGroup, ClusterServer
from tests.support.faults import aof_copy, memory_full, roll_back
from tests.support.proxy import Proxy
from tests.support.redis_group import Process
from tests.support.s3server import shared_s3_env
from tests.support.sentinel import MASTER, SentinelGroup
from tests.support.workers import JOBS_AS_ROOT

JOB_SECONDS = 0.2
LONG_SECONDS = 4.0
LONG_EVERY = 15
SHORT_EVERY = 3
TICK = 0.05
# The policies' run: the users jobs come from, and the configuration of the server and workers.
USERS = ("alice", "bob", "carol")
POLICIES = {
    "GPUPOOL_FAIRSHARE_QUEUES": "default",
    "GPUPOOL_FAIRSHARE_HALF_LIFE": "5",
    "GPUPOOL_USER_MAX_RUNNING_JOBS": "3",
    "GPUPOOL_PREEMPT_QUEUES": "default",
}
# The workflow features' run (tests/chaos/workflows.py): workers with made-up GPUs serving a queue
# of their own, where a job with a priority preempts; pilots with a short lifetime on the default
# queue, replaced as they leave; retries after a short back-off; every job's end POSTed.
GPU_QUEUE = "gpu"
GPU_SIZES = "80,80"  # each GPU worker's made-up GPUs, GiB (tests/support/nvml_seam/pynvml.py)
GPU_MAX_JOBS = 3  # gpu_max_jobs: --gpu-mem jobs that may share one GPU
PILOT_LIFETIME = 16.0  # seconds: a pilot runs a few short jobs, then drains and leaves
PILOT_DRAIN = 3.0
PILOT_KILL_GRACE = 1.0
NOTIFY_TIMEOUT = 2.0
WORKFLOWS = {
    "GPUPOOL_PREEMPT_QUEUES": GPU_QUEUE,
    "GPUPOOL_RETRY_BACKOFF": "0.5",
    "GPUPOOL_RETRY_BACKOFF_MAX": "2",
    "GPUPOOL_GPU_MAX_JOBS": str(GPU_MAX_JOBS),
}
NVML_SEAM = Path(__file__).resolve().parents[1] / "support" / "nvml_seam"


def job_command(
    ledger: Path, seconds: float, *, exit_code: int = 0, fail_first: bool = False, checkpoint: bool = False
) -> list[str]:
    """A job of `seconds` that writes its life to `ledger` (EPOCHREALTIME: no process per line).

    Its start line goes on with what the workflow checks read (tests/chaos/workflow_rules.py):
    `array=ID:INDEX`, the GPUs it was given (`gpus=`, CUDA_VISIBLE_DEVICES) and the memory it
    declared (`mem=`), '-' for none; a `checkpoint` job first reads whose save it found in
    $GPUPOOL_CHECKPOINT_DIR (`restored=JOB,LEASE`), then saves its own name there, whole (a
    rename), for the pool to carry to its next attempt. It ends with `exit_code`, or with 1 in its
    first attempt when `fail_first` (a retry then runs it again)."""
    fields = '"$GPUPOOL_JOB_ID" "$GPUPOOL_ATTEMPT" "$GPUPOOL_ATTEMPT_ID" "$GPUPOOL_WORKER" "$1"'
    fields += ' "${EPOCHREALTIME/./}" "$2"'
    found = "r=-; "
    if checkpoint:
        found = (
            'r=-; d=$GPUPOOL_CHECKPOINT_DIR; [ -s "$d/state" ] && read -r r < "$d/state"; '
            'printf "%s,%s\\n" "$GPUPOOL_JOB_ID" "$GPUPOOL_ATTEMPT_ID" > "$d/s.tmp"; '
            'mv "$d/s.tmp" "$d/state"; '
        )
    says = (
        '" array=${GPUPOOL_ARRAY_ID:--}:${GPUPOOL_ARRAY_INDEX:--} gpus=${CUDA_VISIBLE_DEVICES:--} '
        'mem=${GPUPOOL_GPU_MEM:--} restored=$r"'
    )
    ending = f"l end; exit {exit_code}"
    if fail_first:
        ending = 'l end; [ "$GPUPOOL_ATTEMPT" = 1 ] && exit 1; exit 0'
    script = (
        f'l() {{ printf "%s %s %s %s %s %s%s\\n" {fields} >> {ledger}; }}; '
        "trap 'l stopped; exit 143' TERM; "  # stopped (a hand-back): its end, exactly
        f"{found}l start {says}; "
        f"for ((i = 0; i < {round(seconds / TICK)}; i++)); do sleep {TICK}; l tick; done; {ending}"
    )
    return ["bash", "-c", script]


def running_now(ledger: Path) -> set[str]:
    """Jobs whose newest attempt in `ledger` has started and not yet ended or stopped."""
    newest: dict[str, tuple[str, bool]] = {}  # job -> (lease, ended)
    for line in ledger.read_text().splitlines():
        parts = line.split()
        if len(parts) < 6:
            continue
        job, _, lease, _, what = parts[:5]
        if what == "start":
            newest[job] = (lease, False)
        elif what in {"end", "stopped"} and newest.get(job, ("", False))[0] == lease:
            newest[job] = (lease, True)
    return {job for job, (_, ended) in newest.items() if not ended}


@dataclass
class WorkerProc:
    name: str
    proc: subprocess.Popen[bytes]
    killed_at: float | None = None  # time.time() of a SIGKILL: its jobs died with it (orphan guard)
    kind: str = "plain"  # "plain", "gpu" (made-up GPUs, GPU_QUEUE) or "pilot" (a lifetime)
    replaced: bool = False  # a pilot that left, or any worker killed: another took its place


@dataclass
class Faults:
    worker_kill: int = 0
    worker_stop: int = 0
    redis_restart: int = 0
    redis_rollback: int = 0
    redis_full: int = 0
    stale_replies: int = 0
    server_restart: int = 0
    idempotency_storm: int = 0
    failover: int = 0
    failover_seconds: list[float] = field(default_factory=list)  # SIGKILL -> a replica promoted
    requeue: int = 0  # RequeueJobs sent for running checkpointing jobs (workflows)
    requeued: int = 0  # jobs those stopped and put back at the front
    pilots_left: int = 0  # pilots that left by themselves at their end, each replaced (not a fault)
    # pilots that could not register, started while Redis refused writes (its memory limit, a
    # restart): they exit at once, as a worker does that cannot reach Redis at its start
    pilots_refused: int = 0
    pilot_failures: int = 0  # pilots that ended otherwise than either
    log: list[tuple[float, str]] = field(default_factory=list)
    # (copied at, killed at): what was written to Redis in between was lost
    rollbacks: list[tuple[float, float]] = field(default_factory=list)

    def note(self, what: str) -> None:
        self.log.append((time.time(), what))


class Cluster:
    def __init__(
        self,
        tmp: Path,
        redis: EmbeddedRedis | SentinelGroup | ClusterGroup,
        *,
        lease: float,
        slots: int = 2,
        s3_env: dict[str, str] | None = None,
        policies: bool = False,
        workflows: bool = False,
        notify_url: str = "",
        notify_secret: str = "",
    ) -> None:
        """With `policies`, the scheduling policies are on (POLICIES: fair share, a cap per user,
        preemption by priority) and jobs come from USERS, each allowed priorities. With
        `workflows`, WORKFLOWS' settings, and the server POSTs every job's end to `notify_url`."""
        self.tmp = tmp
        self.policies = policies
        self.workflows = workflows
        self.notify_secret = notify_secret
        self.notify = {
            "GPUPOOL_NOTIFY_URL": notify_url,
            "GPUPOOL_NOTIFY_SECRET": notify_secret,
            "GPUPOOL_NOTIFY_TIMEOUT": str(NOTIFY_TIMEOUT),
            "GPUPOOL_NOTIFY_ALLOW": "127.0.0.1/32",  # the receiver's loopback, which a pool refuses
        }
        self.requeueable: set[str] = set()  # jobs that checkpoint: the requeue fault stops them
        self.s3_env = s3_env or shared_s3_env()  # a worker, and the server, need their bucket
        self.redis = redis
        self.lease = lease
        self.slots = slots
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.tokens = {user: secrets.token_urlsafe(24) for user in ("chaos", *USERS)}
        self.token = self.tokens["chaos"]
        self.tokens_file = tmp / "tokens.toml"
        self.tokens_file.write_text(
            "".join(f'{u} = {{ token = "{t}", max_priority = 10 }}\n' for u, t in self.tokens.items())
        )
        self.tokens_file.chmod(0o600)
        self.ledger = tmp / "ledger.txt"
        self.ledger.touch()
        self.server: subprocess.Popen[bytes] | None = None
        self.workers: list[WorkerProc] = []
        self.faults = Faults()
        self._count = 0
        # The first worker reaches a single Redis through it (stale replies).
        self.proxy = Proxy(redis.port) if isinstance(redis, EmbeddedRedis) else None
        self._dead: list[Process] = []  # Sentinel group nodes killed, to start again

    def _env(self) -> dict[str, str]:
        env = dict(
            os.environ,
            XDG_CONFIG_HOME=str(self.tmp / "xdg"),
            GPUPOOL_MAIN_SERVER_REDIS_PASSWORD=self.redis.password,
            **self.s3_env,
            **JOBS_AS_ROOT,  # its jobs write where only root may
            **(POLICIES if self.policies else {}),
            **(WORKFLOWS if self.workflows else {}),
        )
        if isinstance(self.redis, SentinelGroup):
            env.update(
                GPUPOOL_REDIS_SENTINELS=",".join(self.redis.sentinel_addresses),
                GPUPOOL_REDIS_SENTINEL_MASTER=MASTER,
                GPUPOOL_REDIS_SENTINEL_PASSWORD=self.redis.sentinel_password,
                GPUPOOL_REDIS_MIN_REPLICAS_ACK="1",
            )
        if isinstance(self.redis, ClusterGroup):
            env.update(
                GPUPOOL_REDIS_CLUSTER_NODES=",".join(p.address for p in self.redis.processes()),
                GPUPOOL_REDIS_MIN_REPLICAS_ACK="1",
            )
        return env

    def _common(self, redis_port: int | None = None) -> list[str]:
        where = (
            ["--redis-port", str(redis_port or self.redis.port)]
            if isinstance(self.redis, EmbeddedRedis)
            else []
        )
        return [
            "--worker-mode",
            "multinode",
            *where,
            "--worker-healthy-response-period",
            str(self.lease),
            "--heartbeat-interval",
            str(self.lease / 8),
            "--metrics-listen",
            "127.0.0.1:0",
            "--log-level",
            "warning",
        ]

    def _spawn(
        self, argv: list[str], log_name: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with open(self.tmp / log_name, "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "daemon.main", *argv],
                env={**self._env(), **(env or {})},
                stdout=log,
                stderr=log,
            )

    async def start_server(self) -> None:
        self.server = self._spawn(
            [
                *self._common(),
                "--listen",
                self.address,
                "--tokens-file",
                str(self.tokens_file),
                "--data-dir",
                str(self.tmp / "server"),
            ],
            "server.log",
            self.notify if self.notify["GPUPOOL_NOTIFY_URL"] else None,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                await writer.wait_closed()
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the server did not start; see server.log")

    async def restart_server(self) -> None:
        assert self.server is not None
        self.faults.server_restart += 1
        self.faults.note("server restart")
        self.server.terminate()
        await asyncio.to_thread(self.server.wait, 30)
        await self.start_server()

    def start_worker(self, kind: str = "plain") -> WorkerProc:
        """A `poold --worker` process of `kind` (WorkerProc.kind); the first reaches a single Redis
        through the proxy."""
        self._count += 1
        name = f"w{self._count}"
        argv = [
            "--worker",
            *self._common(self.proxy.port if self.proxy is not None and self._count == 1 else None),
            "--worker-remote-processors",
            str(self.slots),
            "--data-dir",
            str(self.tmp / name),
        ]
        env: dict[str, str] = {}
        if kind == "pilot":
            argv += ["--worker-max-lifetime", str(PILOT_LIFETIME), "--drain-timeout", str(PILOT_DRAIN)]
            argv += ["--kill-grace", str(PILOT_KILL_GRACE)]
        else:
            argv += ["--drain-timeout", "30"]
        if kind == "gpu":
            argv += ["--queues", GPU_QUEUE]
            path = os.pathsep.join(p for p in (str(NVML_SEAM), os.environ.get("PYTHONPATH", "")) if p)
            env = {"PYTHONPATH": path, "FAKE_NVML_GPUS": GPU_SIZES, "FAKE_NVML_HOST": name}
        worker = WorkerProc(name, self._spawn(argv, f"{name}.log", env), kind=kind)
        self.workers.append(worker)
        return worker

    async def keep_pilots(self, until: asyncio.Event) -> None:
        """Start a pilot in the place of each one that left by itself (its lifetime over), as a
        batch system starts the next pilot job, until `until` is set. A pilot's end is a clean
        exit; one that exits otherwise is counted, apart from those whose registration Redis
        refused (its log says so)."""
        while not until.is_set():
            for worker in list(self.workers):
                code = worker.proc.poll()
                if worker.kind != "pilot" or worker.replaced or worker.killed_at or code is None:
                    continue
                worker.replaced = True
                if code == 0:
                    self.faults.pilots_left += 1
                elif "cannot register" in (self.tmp / f"{worker.name}.log").read_text():
                    self.faults.pilots_refused += 1
                else:
                    self.faults.pilot_failures += 1
                    self.faults.note(f"pilot {worker.name} exited {code}; see its log")
                self.start_worker("pilot")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(until.wait(), 0.25)

    async def workers_registered(self, count: int, timeout: float = 60.0) -> None:
        """Wait until `count` workers are registered: the pool is up before the faults begin (a
        worker that cannot reach Redis at its start exits, for systemd to start it again, which
        the harness does not do)."""
        deadline = time.monotonic() + timeout
        async with self.queue() as queue:
            while len(await registry.list_workers(queue.redis)) < count:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{count} workers did not register; see the w*.log files")
                await asyncio.sleep(0.1)

    def kill_worker(self, worker: WorkerProc) -> None:
        self.faults.worker_kill += 1
        self.faults.note(f"SIGKILL {worker.name}")
        worker.proc.kill()
        worker.proc.wait(10)
        worker.killed_at = time.time()

    async def stop_worker_for(self, worker: WorkerProc, seconds: float) -> None:
        """SIGSTOP longer than the lease, then SIGCONT: the zombie comes back to stale leases."""
        self.faults.worker_stop += 1
        self.faults.note(f"SIGSTOP {worker.name} for {seconds:g} s")
        worker.proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(seconds)
        worker.proc.send_signal(signal.SIGCONT)

    async def inject(self, kind: str, rng: random.Random) -> None:
        """One fault of `kind` (test_chaos.KINDS), its details drawn from `rng`."""
        alive = [w for w in self.workers if w.proc.poll() is None and w.killed_at is None]
        if kind == "kill" and alive[1:]:  # w1 (behind the proxy) stays, for "stale"
            victim = rng.choice(alive[1:])
            self.kill_worker(victim)
            victim.replaced = True
            self.start_worker(victim.kind)
        elif kind == "stop" and alive:
            await self.stop_worker_for(rng.choice(alive), self.lease * 2)
        elif kind == "redis":
            await self.restart_redis()
        elif kind == "rollback":
            await self.roll_back_redis(rng.uniform(0.2, 1.0))
        elif kind == "full":
            await self.fill_redis_for(self.lease * 2)
        elif kind == "stale":
            await self.delay_replies_for(rng.uniform(0.3, 1.5), self.lease * 2)
        elif kind == "server":
            await self.restart_server()
        elif kind == "failover":
            await self.fail_over()
        elif kind == "requeue":
            await self.requeue_running(rng)

    async def requeue_running(self, rng: random.Random) -> None:
        """`poolctl requeue` (RequeueJobs) of up to two checkpointing jobs that run now, by the
        ledger (waiting up to two leases for one to run): each is stopped, saves, and goes back to
        the front, to resume from its save."""
        self.faults.requeue += 1
        deadline = time.monotonic() + 2 * self.lease
        while not (running := sorted(running_now(self.ledger) & self.requeueable)):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        chosen = rng.sample(running, min(2, len(running)))
        self.faults.note(f"requeue {' '.join(chosen) or '(none running)'}")
        if not chosen:
            return
        client = self.client()
        try:
            await client.connect()
            reply = await client.call(RequeueJobs(chosen), Requeued)
        except ClientError as exc:
            self.faults.note(f"requeue not sent: {exc}")  # a fault before it (the server restarting)
            return
        finally:
            with contextlib.suppress(Exception):
                await client.close()
        self.faults.requeued += sum(1 for state in reply.states.values() if state == "requeueing")

    async def fail_over(self) -> None:
        """SIGKILL the Sentinel group's primary and wait for a replica's promotion; the node
        killed at the last failover is started again first (so there is a replica to promote)."""
        group = self.redis
        if isinstance(group, ClusterGroup):
            await self.fail_over_shard(group)
            return
        assert isinstance(group, SentinelGroup)
        for node in self._dead:
            await asyncio.to_thread(group.restart, node)
        self._dead.clear()
        old = await asyncio.to_thread(group.primary)
        self.faults.failover += 1
        self.faults.note(f"redis primary :{old.port} SIGKILLed")
        started = time.monotonic()
        await asyncio.to_thread(group.kill, old)
        self._dead.append(old)
        new = await asyncio.to_thread(group.wait_failover, old)
        self.faults.failover_seconds.append(time.monotonic() - started)
        self.faults.note(f"redis :{new.port} promoted")

    async def fail_over_shard(self, group: ClusterGroup) -> None:
        """SIGKILL the primary of a shard (the default queue's, then the pool-wide keys', in
        turn), wait until its replica serves its slots, and start it again as that one's replica."""
        key = keys.stream("default") if self.faults.failover % 2 == 0 else keys.WORKERS
        slot = await asyncio.to_thread(group.keyslot, key)
        port = await asyncio.to_thread(group.owner, slot)
        old = next(p for p in group.processes() if p.port == port)
        self.faults.failover += 1
        self.faults.note(f"cluster primary :{port} of slot {slot} SIGKILLed")
        started = time.monotonic()
        await asyncio.to_thread(group.kill, old)
        new = await asyncio.to_thread(group.wait_failover, slot, port)
        self.faults.failover_seconds.append(time.monotonic() - started)
        self.faults.note(f"cluster node :{new} promoted")
        await asyncio.to_thread(group.restart, old)
        self.faults.note(f"cluster node :{port} back, a replica")

    async def restart_redis(self) -> None:
        assert isinstance(self.redis, EmbeddedRedis)
        self.faults.redis_restart += 1
        self.faults.note("redis kill -9 + restart")
        await asyncio.to_thread(self.redis.kill)
        await asyncio.to_thread(self.redis.start)

    async def roll_back_redis(self, after: float) -> None:
        """Copy the AOF, let `after` seconds of writes happen, then restart Redis from the copy."""
        assert isinstance(self.redis, EmbeddedRedis)
        self.faults.redis_rollback += 1
        copied = time.time()
        copy = await asyncio.to_thread(aof_copy, self.redis)
        await asyncio.sleep(after)
        self.faults.note(f"redis rolled back {after:.2f} s")
        self.faults.rollbacks.append((copied, time.time()))
        await asyncio.to_thread(roll_back, self.redis, copy)

    async def fill_redis_for(self, seconds: float) -> None:
        assert isinstance(self.redis, EmbeddedRedis)
        self.faults.redis_full += 1
        self.faults.note(f"redis at maxmemory for {seconds:g} s")
        async with memory_full(self.redis):
            await asyncio.sleep(seconds)

    async def delay_replies_for(self, delay: float, seconds: float) -> None:
        """Replies from Redis to the first worker come `delay` late for a while."""
        assert self.proxy is not None
        self.faults.stale_replies += 1
        self.faults.note(f"replies to w1 {delay:g} s late for {seconds:g} s")
        self.proxy.delay(delay)
        await asyncio.sleep(seconds)
        self.proxy.delay(0)

    async def stop_all(self) -> None:
        for worker in self.workers:
            if worker.proc.poll() is None:
                worker.proc.send_signal(signal.SIGCONT)
                worker.proc.terminate()
        for worker in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(worker.proc.wait, 40)
            if worker.proc.poll() is None:
                worker.proc.kill()
                worker.proc.wait(5)
        if self.server is not None:
            self.server.terminate()
            await asyncio.to_thread(self.server.wait, 30)
        if self.proxy is not None:
            await self.proxy.stop()

    @contextlib.asynccontextmanager
    async def queue(self) -> AsyncIterator[JobQueue]:
        """A JobQueue on the pool's Redis (its primary, on a Sentinel group), for the checker."""
        if isinstance(self.redis, EmbeddedRedis | ClusterGroup):
            client = (
                self.redis.client()
                if isinstance(self.redis, EmbeddedRedis)
                else ClusterServer(self.redis).client()
            )
            try:
                yield JobQueue(client)
            finally:
                await client.aclose()
            return
        client, manager = connect_sentinel(
            parse_host_ports(self.redis.sentinel_addresses),
            MASTER,
            password=self.redis.password,
            sentinel_password=self.redis.sentinel_password,
        )
        try:
            yield JobQueue(client)
        finally:
            await client.aclose()
            await manager.aclose()

    def client(self, user: str = "chaos") -> PoolClient:
        return PoolClient(self.address, user, self.tokens[user])


# Answers that judged a submission: sending it again cannot change them.
FINAL = {ErrorCode.INVALID_ARGUMENT, ErrorCode.NOT_FOUND, ErrorCode.CONFLICT, ErrorCode.PERMISSION_DENIED}


class Refused(Exception):
    """The server refused a submission (FINAL), saying why (a job it waits for is not there)."""


class Submitter:
    """Submits jobs with idempotency keys, retrying through server restarts; records every id it
    was given (the jobs the pool must not lose)."""

    def __init__(self, cluster: Cluster, user: str = "chaos") -> None:
        self.cluster = cluster
        self.user = user
        self.ids: dict[str, str] = {}  # idempotency key -> job id
        self.acked: dict[str, float] = {}  # job id -> when the pool said it had it
        self._client: PoolClient | None = None

    async def submit(self, key: str, spec: dict[str, object]) -> str:
        for _ in range(200):
            try:
                if self._client is None:
                    self._client = self.cluster.client(self.user)
                    await self._client.connect()
                reply = await self._client.call(Enqueue(spec, key), Enqueued)
            except ClientError as exc:
                await self.close()
                if exc.code in FINAL:
                    raise Refused(str(exc)) from None
                await asyncio.sleep(0.1)
                continue
            self.ids[key] = reply.job_id
            self.acked.setdefault(reply.job_id, time.time())
            return reply.job_id
        raise AssertionError(f"could not submit {key} in 200 tries")

    async def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.close()
            self._client = None
