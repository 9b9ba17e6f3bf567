"""What a job is: its spec (what the user asked for), its state, and what the pool knows of it.

These are plain data: the queue stores them, the server sends them as msgpack maps, `poolctl`
prints them. `JobSpec.from_dict` is the one place a spec from outside is validated.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import random
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from daemon.errors import InvalidJob
from daemon.exclusive import check_combination, check_gpu_request
from daemon.webhook import check_url

MAX_ARGV_BYTES = 256 * 1024
FULL_SHA = re.compile(r"[0-9a-f]{40}")
MAX_ATTEMPTS_LIMIT = 100
GPU_MEM_MAX = 2**50  # bytes a --gpu-mem job may declare (a PiB: no GPU comes near it)
CPUS_MAX, MEM_MAX = 4096, 2**50  # the most CPUs and bytes of memory a job may ask for
MEM_MIN = 2**20  # the least memory a job may ask for (--mem 4096 is a mistake for 4096M)
PRIORITY_MAX = 100  # the highest --priority (daemon/queue/lua/lib/arrays.lua PRIO_MAX says the same)
MAX_INPUTS = 256
SHA256 = re.compile(r"[0-9a-f]{64}")
INPUT_KINDS = ("file", "dir")
# A project's files travel as packs (daemon/ctl/project_packs.py), each a content-addressed object
# of ~8 MiB: a project within the default project_max_bytes holds some 64 of them.
MAX_PROJECT_PACKS = 512


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


QUEUE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
JOB_ID = re.compile(r"([A-Za-z0-9_-]{1,64})\.([0-9a-z]{8,32})")


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


def check_queue_name(name: object, field_name: str = "queue") -> str:
    if not isinstance(name, str) or QUEUE_NAME.fullmatch(name) is None:
        raise InvalidJob(field_name, f"{name!r} is not a queue name (1-64 of A-Z a-z 0-9 _ -)")
    return name


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
            **({"project": _project_copy(self.project)} if self.project is not None else {}),
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
        fields: dict[str, Any] = {"argv": _argv(data.get("argv"))}
        for name, value in data.items():
            default = _DEFAULTS.get(name, _NO_DEFAULT)
            if value is default or (type(value) is type(default) and value == default):
                continue  # the JobSpec's own default, which needs no check
            if (check := _CHECKS.get(name)) is not None:  # (argv: checked first)
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


def _argv(argv: object) -> tuple[str, ...]:
    if not isinstance(argv, list | tuple) or not argv or not all(isinstance(a, str) for a in argv):
        raise InvalidJob("argv", "must be a non-empty list of strings (the command to run)")
    if sum(len(a) for a in argv) > MAX_ARGV_BYTES:
        raise InvalidJob("argv", f"is longer than {MAX_ARGV_BYTES} bytes")
    if any("\0" in a for a in argv):
        raise InvalidJob("argv", "contains a NUL byte, which no program can be passed")
    return tuple(argv)


def _env(data: Mapping[str, Any]) -> dict[str, str]:
    env = data.get("env") or {}
    if not isinstance(env, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and k and "=" not in k for k, v in env.items()
    ):
        raise InvalidJob("env", "must map variable names (without '=') to string values")
    if any("\0" in k or "\0" in v for k, v in env.items()):
        raise InvalidJob("env", "contains a NUL byte, which no environment can hold")
    return dict(env)


def _cwd(data: Mapping[str, Any]) -> str | None:
    cwd = _opt_str(data, "cwd")
    if cwd is not None and "\0" in cwd:
        raise InvalidJob("cwd", "contains a NUL byte, which no path can")
    return cwd


def _notify(value: object) -> str:
    if value is None or value == "":
        return ""
    try:
        return check_url(value)
    except ValueError as exc:
        raise InvalidJob("notify", f"{value!r} is not valid: {exc}") from None


MAX_AFTER = 100  # jobs one job may wait for
_DEPENDENCY = re.compile(rf"(?P<job>{JOB_ID.pattern})(?::(?P<how>ok|fail|any))?")


def _after(value: object) -> tuple[str, ...]:
    """`after`: a list of "JOB" or "JOB:ok|fail|any" (daemon/after.py); each becomes "JOB:how"."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise InvalidJob("after", "must be a list of JOB or JOB:ok|fail|any")
    if len(value) > MAX_AFTER:
        raise InvalidJob("after", f"a job may wait for at most {MAX_AFTER} others")
    out = []
    for v in value:
        if (m := _DEPENDENCY.fullmatch(v)) is None:
            raise InvalidJob("after", f"{v!r} is not a job id with an optional :ok, :fail or :any")
        out.append(f"{m['job']}:{m['how'] or 'ok'}")
    return tuple(dict.fromkeys(out))


MAX_ARRAY = 100_000  # jobs in one array
ARRAY_ID = re.compile(r"([A-Za-z0-9_-]{1,64})@([0-9a-z]{4,32})")


def _array(value: object, queue: object) -> str:
    """`array`: "QUEUE@ID", of the job's own queue (an array's jobs share one), or ""."""
    if value in (None, ""):
        return ""
    if not isinstance(value, str) or (m := ARRAY_ID.fullmatch(value)) is None or m[1] != queue:
        raise InvalidJob("array", f"{value!r} is not QUEUE@ID with the job's own queue")
    return value


def _git(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("repo"), str) or not value["repo"]:
        raise InvalidJob("git", 'must be a map with "repo" and a "commit" or a "ref"')
    if value["repo"].startswith("-") or str(value.get("ref", "")).startswith("-"):
        raise InvalidJob(
            "git", "a repository or ref may not start with '-' (git would take it for an option)"
        )
    unknown = set(value) - {"repo", "commit", "ref"}
    if unknown or not all(isinstance(v, str) for v in value.values()):
        raise InvalidJob(
            "git", f'takes string values for "repo", "commit" and "ref" only, not {sorted(unknown)}'
        )
    if "commit" in value and not FULL_SHA.fullmatch(value["commit"]):
        raise InvalidJob("git", f"commit {value['commit']!r} is not a full 40-digit commit id")
    if "commit" not in value and "ref" not in value:
        raise InvalidJob("git", 'needs a "commit" or a "ref"')
    return dict(value)


def check_dest(dest: object) -> str:
    """A place inside the job's directory: a relative path without `..`, `.` or empty segments."""
    if not isinstance(dest, str) or not dest or dest.startswith("/") or "\x00" in dest or "\\" in dest:
        raise InvalidJob("inputs", f"dest {dest!r} must be a relative path inside the job's directory")
    if any(part in {"", ".", ".."} for part in dest.split("/")):
        raise InvalidJob("inputs", f"dest {dest!r} must not contain '..', '.' or empty segments")
    return dest


def _inputs(value: object) -> tuple[dict[str, str], ...]:
    if value is None or value == []:
        return ()
    if not isinstance(value, list | tuple) or len(value) > MAX_INPUTS:
        raise InvalidJob("inputs", f"must be a list of at most {MAX_INPUTS} maps")
    out: list[dict[str, str]] = []
    for item in value:
        if not isinstance(item, Mapping) or set(item) != {"sha256", "dest", "kind"}:
            raise InvalidJob("inputs", 'each input is a map of exactly "sha256", "dest" and "kind"')
        if not isinstance(item["sha256"], str) or not SHA256.fullmatch(item["sha256"]):
            raise InvalidJob("inputs", f"sha256 {item['sha256']!r} is not 64 lowercase hex digits")
        if item["kind"] not in INPUT_KINDS:
            raise InvalidJob("inputs", f"kind {item['kind']!r} must be one of {', '.join(INPUT_KINDS)}")
        out.append({"sha256": item["sha256"], "dest": check_dest(item["dest"]), "kind": item["kind"]})
    dests = [i["dest"] for i in out]
    if len(set(dests)) != len(dests):
        raise InvalidJob("inputs", "two inputs have the same dest")
    return tuple(out)


def _snapshot(value: object) -> dict[str, Any] | None:
    if value is None:
        return None
    if (
        not isinstance(value, Mapping)
        or set(value) != {"sha256", "commit", "dirty"}
        or not isinstance(value["sha256"], str)
        or not SHA256.fullmatch(value["sha256"])
        or not isinstance(value["commit"], str)
        or not isinstance(value["dirty"], bool)
    ):
        raise InvalidJob(
            "snapshot", 'must be a map of "sha256" (64 hex digits), "commit" (str), "dirty" (bool)'
        )
    return dict(value)


def project_id(packs: Iterable[str]) -> str:
    """A project snapshot's id: the sha256 of its packs' sha256s, one a line (each pack is a
    deterministic tar of its files, so the same files give the same id)."""
    return hashlib.sha256("".join(f"{p}\n" for p in packs).encode()).hexdigest()


_PROJECT_KEYS = {"id", "packs", "dir", "commit", "dirty", "files", "size"}


def _project(value: object) -> dict[str, Any] | None:
    """`project`: the packs are content addresses, `dir` a relative path inside the job's
    directory ("" for its top), `id` the one `project_id` gives of the packs."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) != _PROJECT_KEYS:
        raise InvalidJob("project", f"must be a map of exactly {', '.join(sorted(_PROJECT_KEYS))}")
    packs = value["packs"]
    if (
        not isinstance(packs, list | tuple)
        or len(packs) > MAX_PROJECT_PACKS
        or not all(isinstance(p, str) and SHA256.fullmatch(p) for p in packs)
    ):
        raise InvalidJob("project", f"packs must be a list of at most {MAX_PROJECT_PACKS} sha256s")
    if value["id"] != project_id(packs):
        raise InvalidJob("project", "its id is not the sha256 of its packs")
    if not isinstance(value["commit"], str) or not isinstance(value["dirty"], bool):
        raise InvalidJob("project", 'takes a "commit" string and a "dirty" true or false')
    for name in ("files", "size"):
        if isinstance(value[name], bool) or not isinstance(value[name], int) or value[name] < 0:
            raise InvalidJob("project", f'"{name}" must be a count from 0')
    if value["dir"] != "":
        try:
            check_dest(value["dir"])
        except InvalidJob:
            raise InvalidJob(
                "project", f"dir {value['dir']!r} must be a relative path inside the project"
            ) from None
    return _project_copy(value)


def _project_copy(value: Mapping[str, Any]) -> dict[str, Any]:
    return {**value, "packs": list(value["packs"])}


def _opt_str(data: Mapping[str, Any], name: str) -> str | None:
    value = data.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidJob(name, f"must be a string, not {type(value).__name__}")
    return value


def _bool(data: Mapping[str, Any], name: str) -> bool:
    value = data.get(name, False)
    if not isinstance(value, bool):
        raise InvalidJob(name, f"must be true or false, not {value!r}")
    return value


def _int(data: Mapping[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = data.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidJob(name, f"must be an integer from {lo} to {hi}, not {value!r}")
    return value


def _mem(data: Mapping[str, Any]) -> int:
    """`mem`: none (0), or bytes from a MiB to MEM_MAX."""
    mem = _int(data, "mem", 0, 0, MEM_MAX)
    if 0 < mem < MEM_MIN:
        raise InvalidJob(
            "mem", f"must be at least 1 MiB ({MEM_MIN} bytes), not {mem}: a size with a unit, e.g. 4G"
        )
    return mem


def _opt_positive(data: Mapping[str, Any], name: str, most: float | None = None) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise InvalidJob(name, f"must be a positive number of seconds, not {value!r}")
    if most is not None and value > most:
        raise InvalidJob(name, f"must be at most {most:g} seconds, not {value!r}")
    return float(value)


# The signals a job may ask to be stopped with: those a program can catch to save its state.
STOP_SIGNALS = ("TERM", "INT", "HUP", "USR1", "USR2", "QUIT")
MAX_STOP_GRACE = 3600.0  # a drain waits this long at most for a job to save itself


def _stop_signal(data: Mapping[str, Any]) -> str:
    value = data.get("stop_signal", "TERM")
    name = value.upper().removeprefix("SIG") if isinstance(value, str) else value
    if name not in STOP_SIGNALS:
        raise InvalidJob("stop_signal", f"must be one of {', '.join(STOP_SIGNALS)}, not {value!r}")
    return str(name)


# Each field of a spec but `argv`: what the JobSpec holds for the field as `data` gives it, or
# InvalidJob saying why it cannot (JobSpec.from_dict).
_CHECKS: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "queue": lambda d: check_queue_name(d["queue"]),
    "name": lambda d: _opt_str(d, "name") or "",
    "env": _env,
    "cwd": _cwd,
    "gpus": lambda d: _int(d, "gpus", 0, 0, 1024),
    "gpu_mem": lambda d: _int(d, "gpu_mem", 0, 0, GPU_MEM_MAX),
    "cpus": lambda d: _int(d, "cpus", 0, 0, CPUS_MAX),
    "mem": _mem,
    "wait_for_worker": lambda d: _bool(d, "wait_for_worker"),
    "timeout": lambda d: _opt_positive(d, "timeout"),
    "checkpoint_every": lambda d: _opt_positive(d, "checkpoint_every"),
    "stop_signal": _stop_signal,
    "stop_grace": lambda d: _opt_positive(d, "stop_grace", MAX_STOP_GRACE),
    "max_attempts": lambda d: _int(d, "max_attempts", 3, 1, MAX_ATTEMPTS_LIMIT),
    "retries": lambda d: _int(d, "retries", 0, 0, MAX_ATTEMPTS_LIMIT),
    "priority": lambda d: _int(d, "priority", 0, 0, PRIORITY_MAX),
    "user": lambda d: _opt_str(d, "user") or "",
    "git": lambda d: _git(d["git"]),
    "inputs": lambda d: _inputs(d["inputs"]),
    "snapshot": lambda d: _snapshot(d["snapshot"]),
    "project": lambda d: _project(d["project"]),
    "after": lambda d: _after(d["after"]),
    "notify": lambda d: _notify(d["notify"]),
    "env_from_lock": lambda d: _bool(d, "env_from_lock"),
    "tty": lambda d: _bool(d, "tty"),
    "idle_limit": lambda d: _opt_positive(d, "idle_limit"),
    "array": lambda d: _array(d["array"], d.get("queue", "default")),
    "array_index": lambda d: _int(d, "array_index", 0, 0, 2**31),
    "array_pos": lambda d: _int(d, "array_pos", 0, 0, MAX_ARRAY),
    "array_limit": lambda d: _int(d, "array_limit", 0, 0, MAX_ARRAY),
}
_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(JobSpec))
assert {"argv", *_CHECKS} == _FIELD_NAMES, "every field of JobSpec but argv has its check"
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
