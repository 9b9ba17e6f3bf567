"""The checks of a job spec's fields: each field as a client sent it becomes what a `JobSpec` holds,
or `InvalidJob` naming the field and saying what it must be; and the limits, names and ids the
checks hold a spec to.

`JobSpec.from_dict` (daemon/job.py) runs them: `check_argv` first, then `CHECKS`, one per other
field. poolctl's own bounds (daemon/ctl/enqueue_args.py) and the Lua scripts' say the same.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from daemon.errors import InvalidJob
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

QUEUE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A job's id, QUEUE.SUFFIX (daemon/job.py's new_job_id makes them, its queue_of reads them).
JOB_ID = re.compile(r"([A-Za-z0-9_-]{1,64})\.([0-9a-z]{8,32})")


def check_queue_name(name: object, field_name: str = "queue") -> str:
    if not isinstance(name, str) or QUEUE_NAME.fullmatch(name) is None:
        raise InvalidJob(field_name, f"{name!r} is not a queue name (1-64 of A-Z a-z 0-9 _ -)")
    return name


def check_argv(argv: object) -> tuple[str, ...]:
    """`argv`, the command to run: checked before every other field (JobSpec.from_dict)."""
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
    return project_copy(value)


def project_copy(value: Mapping[str, Any]) -> dict[str, Any]:
    """A `project` map of the JobSpec's own, its packs a list (as `to_dict` writes it)."""
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
CHECKS: dict[str, Callable[[Mapping[str, Any]], Any]] = {
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
