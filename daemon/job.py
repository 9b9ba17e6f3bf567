"""What a job is: its spec (what the user asked for), its state, and what the pool knows of it.

These are plain data: the queue stores them, the server sends them as msgpack maps, `poolctl`
prints them. `JobSpec.from_dict` is the one place a spec from outside is validated, by the checks of
its fields (daemon/spec_checks.py).
"""

from __future__ import annotations

import dataclasses
import enum
import random
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from daemon.errors import InvalidJob
from daemon.exclusive import check_combination, check_gpu_request
from daemon.spec_checks import CHECKS, JOB_ID, check_argv, project_copy


class JobState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DEAD = "dead"  # dead-lettered: lost or crashed on max_attempts attempts

    @property
    def terminal(self) -> bool:
        return self not in (JobState.QUEUED, JobState.RUNNING)


TERMINAL_STATES = frozenset(s for s in JobState if s.terminal)
_B36 = "0123456789abcdefghijklmnopqrstuvwxyz"


def _base36(n: int) -> str:
    out = ""
    while n:
        n, r = divmod(n, 36)
        out = _B36[r] + out
    return out or "0"


AGENT_ID = re.compile(r"-agent-[0-9a-f]{16}\Z")  # what ends an agent's worker's id, never another's


def is_agent_worker(worker_id: str) -> bool:
    """Whether `worker_id` is an agent's worker (its jobs run on the agent's machine, which the
    server reaches only through the agent's connection; queue/registry.py names them)."""
    return AGENT_ID.search(worker_id) is not None


def new_job_id(queue: str) -> str:
    """`QUEUE.` + milliseconds in base 36 + 5 random base-36 digits: short, sortable, unique enough
    (an id that exists already is made unique by the enqueue scripts, lua/lib/record.lua free_job_id)."""
    # Not secret (ids are not credentials; a collision is caught by the scripts), so the fast
    # generator, which the random module reseeds in a forked child.
    rand = _base36(36**5 + random.randrange(36**5))[1:]
    return f"{queue}.{_base36(time.time_ns() // 1_000_000)}{rand}"


def queue_of(job_id: str) -> str:
    """The queue a job id belongs to (the part before the dot), or InvalidJob naming the id: ids come
    from users, and the id alone names every Redis key of its job (daemon/queue/keys.py)."""
    m = JOB_ID.fullmatch(job_id)
    if m is None:
        raise InvalidJob("id", f"{job_id!r} is not a job id (expected QUEUE.ID, e.g. default.0mzk4g8x1a2b)")
    return m.group(1)


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What a user submits. `argv` runs as a process (no shell) with `env` added to its environment."""

    argv: tuple[str, ...]
    queue: str = "default"
    name: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    gpus: int = 0
    # Bytes of memory the job asks for on one GPU that other pool jobs may share (0: whole GPUs, as
    # `gpus` says). Such a job asks for no whole GPU: the two exclude each other.
    gpu_mem: int = 0
    # The CPUs and bytes of memory it needs on its worker (0: none asked): a worker starts it only
    # with that much free (claim/host.lua), and its slot's cgroup holds it to them (cgroups.py).
    cpus: int = 0
    mem: int = 0
    # Queue it even if no worker of the pool has `gpus` GPUs (the server refuses it otherwise).
    wait_for_worker: bool = False
    timeout: float | None = None  # seconds of run time before the attempt is stopped
    # Seconds between saves of $GPUPOOL_CHECKPOINT_DIR while it runs (None: at its end only).
    checkpoint_every: float | None = None
    # How the job is asked to stop (a cancel, a timeout, a requeue, a drain): this signal to its
    # processes, then SIGKILL after `stop_grace` seconds (None: the worker's kill_grace).
    stop_signal: str = "TERM"
    stop_grace: float | None = None
    max_attempts: int = 3  # attempts lost to dead workers before the job is dead-lettered
    retries: int = 0  # extra attempts after a non-zero exit
    # Claimed before the queue's jobs of lower priority (0: none), up to the user's ceiling.
    priority: int = 0
    user: str = ""  # set by the server from the authenticated connection, never by the client
    git: Mapping[str, str] | None = None  # {"repo": URL or path, "commit": sha, or "ref": name}
    # Datasets placed in the job's directory before it starts: {"sha256", "dest", "kind": file|dir}.
    inputs: tuple[Mapping[str, str], ...] = ()
    # The researcher's working tree as it was at enqueue: {"sha256", "commit", "dirty": bool}.
    snapshot: Mapping[str, Any] | None = None
    # The project it runs in (daemon/ctl/project.py): its files as packs, the job's directory a
    # copy of the project's root, the job started in `dir` within it. {"id", "packs", "dir",
    # "commit", "dirty", "files", "size"}: `id` the sha256 of the packs' sha256s, a line each.
    project: Mapping[str, Any] | None = None
    # Jobs it waits for, each "JOB:ok|fail|any" (daemon/after.py): held out of its queue till then.
    after: tuple[str, ...] = ()
    # One job of an array (`poolctl enqueue --array 0-99%8`): the array's id ("QUEUE@ID"), this
    # job's index ($GPUPOOL_ARRAY_INDEX), its place in the array from 0, and the most of the array
    # under way at once (0: no limit; the rest wait their turn, by place: lib/arrays.lua `admit`).
    array: str = ""
    array_index: int = 0
    array_pos: int = 0
    array_limit: int = 0
    # An http(s) URL the server POSTs the job's final record to when it ends (daemon/webhook.py).
    notify: str = ""
    # Run in the environment built from the lock in its directory (worker/envs.py); false:
    # `poolctl enqueue --no-env`, the worker's own Python.
    env_from_lock: bool = True
    # An interactive job (`poolctl shell`): its first process on a terminal (worker/terminal.py)
    # that its owner attaches to; it ends once no client has sent it input for `idle_limit`
    # seconds (None: the worker's `shell_idle_limit`). Only a tty job has an idle limit.
    tty: bool = False
    idle_limit: float | None = None

    @property
    def held(self) -> bool:
        """May be held out of its queue at enqueue: till the jobs it waits for end
        (daemon/after.py), or till its array's window has a place for it."""
        return bool(self.after) or (bool(self.array) and self.array_limit > 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "argv": list(self.argv),
            "queue": self.queue,
            "name": self.name,
            "env": dict(self.env),
            "cwd": self.cwd,
            "gpus": self.gpus,
            "gpu_mem": self.gpu_mem,
            "wait_for_worker": self.wait_for_worker,
            "timeout": self.timeout,
            "checkpoint_every": self.checkpoint_every,
            "stop_signal": self.stop_signal,
            "stop_grace": self.stop_grace,
            "max_attempts": self.max_attempts,
            "retries": self.retries,
            "priority": self.priority,
            "user": self.user,
            "git": dict(self.git) if self.git is not None else None,
            "inputs": [dict(i) for i in self.inputs],
            **({"after": list(self.after)} if self.after else {}),
            **(
                {
                    "array": self.array,
                    "array_index": self.array_index,
                    "array_pos": self.array_pos,
                    "array_limit": self.array_limit,
                }
                if self.array
                else {}
            ),
            **({"notify": self.notify} if self.notify else {}),  # a worker of before it refuses the key
            **({"cpus": self.cpus} if self.cpus else {}),  # the same
            **({"mem": self.mem} if self.mem else {}),  # the same
            **({} if self.env_from_lock else {"env_from_lock": False}),  # the same
            **({"tty": True} if self.tty else {}),  # the same
            **({"idle_limit": self.idle_limit} if self.idle_limit is not None else {}),  # the same
            "snapshot": dict(self.snapshot) if self.snapshot is not None else None,
            **({"project": project_copy(self.project)} if self.project is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        """Validate a spec from outside; raises InvalidJob naming the field and what it must be.
        A field given as its default (as every stored spec gives most of them: `to_dict` writes
        them all) is taken as it is, unchecked: only the others cost a check, where the server
        takes a spec in and where a worker claims it (most of a stored spec's fields are their
        defaults, and checking them again was much of its decode)."""
        if not _FIELD_NAMES.issuperset(data):
            raise InvalidJob(sorted(set(data) - _FIELD_NAMES)[0], "unknown field")
        fields: dict[str, Any] = {"argv": check_argv(data.get("argv"))}
        for name, value in data.items():
            default = _DEFAULTS.get(name, _NO_DEFAULT)
            if value is default or (type(value) is type(default) and value == default):
                continue  # the JobSpec's own default, which needs no check
            if (check := CHECKS.get(name)) is not None:  # (argv: checked first)
                fields[name] = check(data)
        spec = cls(**fields)
        check_combination(
            {k for k in ("cwd", "git", "inputs", "snapshot", "project") if data.get(k) not in (None, [], ())}
        )
        check_gpu_request(spec.gpus, spec.gpu_mem)
        if spec.idle_limit is not None and not spec.tty:
            raise InvalidJob(
                "idle_limit", "is a shell's (a tty job's, `poolctl shell --idle`); this job has no terminal"
            )
        return spec


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(JobSpec))
assert {"argv", *CHECKS} == _FIELD_NAMES, "every field of JobSpec but argv has its check"
_NO_DEFAULT = object()
_DEFAULTS: dict[str, Any] = {
    f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    for f in dataclasses.fields(JobSpec)
    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
}


@dataclass(frozen=True, slots=True)
class Lease:
    """A worker's right to run one attempt of a job. `id` is the fencing token: every write the
    worker makes for this attempt carries it (with `attempt`) and is refused once it is no longer
    the job's current lease. Unlike the attempt number, a lease id never repeats, not even when
    Redis loses its last writes and a claim it forgot is made again: `WORKER/REQUEST.INDEX`."""

    job_id: str
    attempt: int
    worker: str
    spec: JobSpec
    id: str
    shared_gpu: int = -1  # a --gpu-mem job's GPU: its place in the worker's list (claim.lua)
    # Claimed ahead of a free slot (worker/fast_path.py): counts as never started until its worker
    # says it started (JobQueue.mark_started), so a reclaim of it is no loss (claim.lua).
    ahead: bool = False

    @property
    def queue(self) -> str:
        return self.spec.queue


@dataclass(frozen=True, slots=True)
class Outcome:
    """How an attempt ended, as the worker reports it through the fenced `complete`."""

    state: JobState  # SUCCEEDED, FAILED or CANCELLED
    exit_code: int | None = None
    detail: str = ""  # e.g. "killed by signal 9", "timed out after 60 s"
    result: Mapping[str, Any] = field(default_factory=dict)  # peak RSS, output tail, artifacts…

    def __post_init__(self) -> None:
        if self.state not in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
            raise ValueError(f"an attempt cannot end as {self.state}")


class RenewStatus(enum.StrEnum):
    OK = "ok"
    LOST = "lost"  # the lease was reclaimed (or the job ended): stop the process now
    CANCEL = "cancel"  # the lease holds but the user cancelled: stop the process, complete CANCELLED
    REQUEUE = "requeue"  # the lease holds but the user asked for a requeue: stop it, hand it back
    PREEMPT = "preempt"  # the same, asked by a job of higher priority that needs its GPUs


@dataclass(frozen=True, slots=True)
class Attempt:
    attempt: int
    worker: str
    started_at: float
    ended_at: float | None
    how: str  # running, succeeded, failed, cancelled, lost, released (handed back by a draining worker)
    lease: str = ""  # its lease id, GPUPOOL_ATTEMPT_ID; "" in entries written before claims recorded it

    def to_dict(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "worker": self.worker,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "how": self.how,
            "lease": self.lease,
        }


@dataclass(frozen=True, slots=True)
class JobInfo:
    """Everything the pool knows of one job, for `poolctl show` and `ls`."""

    id: str
    state: JobState
    spec: JobSpec
    seq: int
    attempt: int
    worker: str
    enqueued_at: float
    started_at: float | None
    ended_at: float | None
    exit_code: int | None
    detail: str
    cancel_requested: bool
    attempts: tuple[Attempt, ...] = ()
    result: Mapping[str, Any] = field(default_factory=dict)
    lease: str = ""  # the current (or last) attempt's lease id, GPUPOOL_ATTEMPT_ID in its job
    # The save a next attempt restores (worker/checkpoints.py), recorded by an attempt that held the job
    checkpoint: str = ""
    # What the last attempt's GPUs did (worker/gpu_usage.py), once it ended; None without GPUs
    gpu_usage: Mapping[str, Any] | None = None
    # Set when an attempt left its GPUs idle (worker/idle_gpus.py): since when, for how long, what
    # its queue did about it
    idle_gpu: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "state": str(self.state),
            "spec": self.spec.to_dict(),
            "seq": self.seq,
            "attempt": self.attempt,
            "worker": self.worker,
            "enqueued_at": self.enqueued_at,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "exit_code": self.exit_code,
            "detail": self.detail,
            "cancel_requested": self.cancel_requested,
            "attempts": [a.to_dict() for a in self.attempts],
            "result": dict(self.result),
            "lease": self.lease,
            "gpu_usage": None if self.gpu_usage is None else dict(self.gpu_usage),
            "idle_gpu": None if self.idle_gpu is None else dict(self.idle_gpu),
        }
