"""Building a job's environment with uv: as the builder (a uid of its own when the worker is
root: a source build runs the package's code, which must reach neither the worker nor the jobs),
with the operator's index settings in uv's environment (never on a command line, never written
into the environment), binary wheels only unless source builds are allowed, and every process of
the builder's uid killed after each run. Then sealed: given to the worker, read-only.

envs.py decides when a build runs and where it is published; this module runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from daemon.worker.env_lock import PYTHON_VERSION, REQUIREMENTS, UV_LOCK, EnvError, Lock
from daemon.worker.identity import SlotIdentity

PYTHON_NAME = re.compile(r"(python|pypy)(3(\.\d+)?t?)?")  # the interpreters' names on PATH
NO_INDEX = "none"  # worker_env_index_url's value for no index at all (find-links only)
ERROR_LINES = 40  # of uv's output kept for the job's log when a build fails
# What uv gets of the worker's environment besides what the cache sets: the way out to the index.
UV_PASSED_ENV = frozenset(
    {"LANG", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "SSL_CERT_FILE", "SSL_CERT_DIR"}
)
UV_PASSED_ENV |= {name.lower() for name in UV_PASSED_ENV if name.endswith("PROXY")}


class BuildFailed(EnvError):
    """uv could not build the environment: the sentence, and uv's own last lines (`output`)."""

    def __init__(self, message: str, output: Sequence[str]) -> None:
        super().__init__(message)
        self.output = tuple(output)


@dataclasses.dataclass(frozen=True, slots=True)
class EnvSettings:
    """The operator's say over builds (the worker_env_* options)."""

    budget_bytes: int = 20 * 1024**3
    index_url: str = ""
    extra_index_urls: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    python_downloads: bool = False
    source_builds: bool = False
    # The speed switch (env_bytecode.py): publish an environment before its bytecode is made,
    # then make it behind the jobs' backs. Off: uv makes it in the build, before any job runs.
    bytecode_later: bool = True

    def uv_env(self) -> dict[str, str]:
        """The settings as uv's environment variables: never on a command line, which any
        process of the machine may read in /proc."""
        env = {"UV_PYTHON_DOWNLOADS": "automatic" if self.python_downloads else "never"}
        if not self.source_builds:
            env["UV_NO_BUILD"] = "1"
        if self.index_url == NO_INDEX:  # find-links only: a machine with no way out
            env["UV_NO_INDEX"] = "1"
        elif self.index_url:
            env["UV_DEFAULT_INDEX"] = self.index_url
        if self.extra_index_urls:
            env["UV_INDEX"] = " ".join(self.extra_index_urls)
        if self.find_links:
            env["UV_FIND_LINKS"] = ",".join(self.find_links)
        return env


def find_uv() -> str | None:
    """uv: beside this Python (the venv gpupool is installed in, which depends on it), else on PATH."""
    beside = Path(sys.executable).parent / "uv"
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("uv")


class Builder:
    """How a worker runs uv: as `builder` (None: the worker's own uid), with `settings`, the
    worker's PATH, uv's cache under `uv_cache` (one per uid) and the Pythons it downloads in
    `python_dir`; `sweep` kills every process of the builder's uid (the spawner's)."""

    def __init__(
        self,
        settings: EnvSettings,
        *,
        uv_cache: Path,
        python_dir: Path,
        builder: SlotIdentity | None = None,
        sweep: Callable[[SlotIdentity], object] | None = None,
        uv: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self.uv_cache = uv_cache
        self.python_dir = python_dir
        self.builder = builder
        self._sweep = sweep
        self.uv = uv or find_uv()
        self.path = (env if env is not None else os.environ).get("PATH", os.defpath)
        self._passed = {k: v for k, v in os.environ.items() if k in UV_PASSED_ENV}

    async def sweep(self) -> None:
        """Kill every process of the builder's uid: what a build (or a dead worker's) left."""
        if self.builder is not None and self._sweep is not None:
            result = self._sweep(self.builder)
            if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                await result

    def lay_out(self, work: Path, target: Path | None, lock: Lock | None) -> None:
        """A build's directories: its inputs (the lock's files, readable by the builder), and the
        builder's own: its home and temporary directory, uv's cache, and the empty environment
        uv builds into (`target`). Blocking."""
        project = work / "project"
        for path in (work, project, work / "home", work / "tmp", *([target] if target else [])):
            path.mkdir()
            path.chmod(0o755)
        for name, data in (lock.files if lock is not None else {}).items():
            (project / name).write_bytes(data)
            (project / name).chmod(0o644)
        cache = self.uv_cache / str(self.builder.uid if self.builder is not None else os.geteuid())
        cache.mkdir(mode=0o700, exist_ok=True)
        if self.builder is not None:
            uid, gid = self.builder.uid, self.builder.gid
            for path in (work / "home", work / "tmp", cache, *([target] if target else [])):
                os.chown(path, uid, gid)

    def environment(self, work: Path) -> dict[str, str]:
        uid = self.builder.uid if self.builder is not None else os.geteuid()
        return {
            **self._passed,
            **self.settings.uv_env(),
            "PATH": self.path,
            "HOME": str(work / "home"),
            "TMPDIR": str(work / "tmp"),
            "UV_CACHE_DIR": str(self.uv_cache / str(uid)),
            "UV_PYTHON_INSTALL_DIR": str(self.python_dir),
            "UV_NO_CONFIG": "1",  # neither the worker's uv.toml nor the user's: these settings only
            "UV_NO_PROGRESS": "1",
            # Hard-linked from uv's cache where uv can (a copy writes every file of the
            # environment again); copied where a sealed environment holds the cache's inode.
            "UV_LINK_MODE": "hardlink",
            # The jobs cannot write .pyc files into the environment: made once, by the builder.
            "UV_COMPILE_BYTECODE": "0" if self.settings.bytecode_later else "1",
        }

    def commands(self, work: Path, target: Path, lock: Lock) -> list[list[str]]:
        assert self.uv is not None
        project = str(work / "project")
        if lock.kind == UV_LOCK:
            # The lock's own project is not installed: the job's directory is its code (and the
            # project's build would run its build backend).
            return [[self.uv, "sync", "--frozen", "--no-install-project", "--project", project]]
        python = str(target / "bin" / "python")
        sync = [self.uv, "pip", "sync", "--python", python, str(work / "project" / lock.kind)]
        if lock.kind == REQUIREMENTS:
            sync.insert(3, "--require-hashes")
        return [[self.uv, "venv", "--quiet", str(target)], sync]

    async def run_uv(self, work: Path, target: Path, lock: Lock) -> None:
        env = self.environment(work)
        env["UV_PROJECT_ENVIRONMENT"] = str(target)
        if version := lock.files.get(PYTHON_VERSION, b"").decode(errors="replace").strip().split("\n")[0]:
            env["UV_PYTHON"] = version  # (what uv would read there, but for UV_NO_CONFIG)
        try:
            for argv in self.commands(work, target, lock):
                code, output = await self.run(argv, env, cwd=work / "project")
                if code != 0:
                    raise BuildFailed(self.why(lock, code, output), output[-ERROR_LINES:])
        finally:
            await self.sweep()

    def why(self, lock: Lock, code: int, output: Sequence[str]) -> str:
        if any("No interpreter found" in line or "no interpreter found" in line for line in output):
            how = (
                "and uv could not download it"
                if self.settings.python_downloads
                else "(worker_env_python_downloads is off: install that Python on the worker, "
                "or allow downloads)"
            )
            return f"the job's {lock.kind} needs a Python this worker does not have {how}"
        return (
            f"cannot build the job's environment from its {lock.kind}: uv failed "
            f"(status {code}; its error is above)"
        )

    async def run(self, argv: list[str], env: Mapping[str, str], cwd: Path) -> tuple[int, list[str]]:
        """Run uv (or Python) as the builder, in a session of its own; its exit status and the
        lines it wrote, errors too. Killed if the caller is cancelled.
        (subprocess's, in a thread: the worker's loop, uvloop, cannot start a process as
        another uid.)"""
        ids: dict[str, Any] = {}
        if self.builder is not None:
            ids = {"user": self.builder.uid, "group": self.builder.gid, "extra_groups": []}
        try:
            proc = subprocess.Popen(  # noqa: ASYNC220 - a fork and an exec; its wait is in a thread
                argv,
                cwd=cwd,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # what it makes readable by the jobs' uids whatever the worker's umask (the
                # shipped units' is 0027): a Python uv downloads, which environments link to
                umask=0o022,
                **ids,
            )
        except OSError as exc:
            raise EnvError(
                f"cannot run uv ({argv[0]}) to build the job's environment: {exc.strerror}"
            ) from None
        done = asyncio.ensure_future(asyncio.to_thread(proc.communicate))
        try:
            out, _ = await asyncio.shield(done)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await done
            raise
        lines = out.decode(errors="replace").splitlines()
        return proc.returncode, [line for line in lines if line.strip()]

    def seal(self, target: Path) -> int:
        """Give the environment to the worker, read-only: a job, and a later build, can run it but
        never change it. Its size in bytes. Blocking."""
        uid, gid = os.geteuid(), os.getegid()
        size = 0
        for top, dirs, files in os.walk(target):
            for name in dirs:
                path = os.path.join(top, name)
                os.chown(path, uid, gid, follow_symlinks=False)
                if not os.path.islink(path):
                    os.chmod(path, 0o755)  # noqa: S103 - every job may read and run it, none write
            for name in files:
                path = os.path.join(top, name)
                st = os.lstat(path)
                os.chown(path, uid, gid, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    os.chmod(path, (stat.S_IMODE(st.st_mode) & ~0o7222) | 0o444)
                    size += st.st_size
        os.chown(target, uid, gid)
        os.chmod(target, 0o755)  # noqa: S103 - the same
        return size

    def toolchain(self) -> str:
        """uv and the Pythons it may build on, part of every key: uv's binary and each
        interpreter on PATH and among those uv downloaded, by real path, size and mtime. Looked
        at once per worker, without running them (uv would run each, most of a second where
        pyenv's shims are on PATH). Blocking."""

        def identity(path: str) -> list[object]:
            st = os.stat(path)
            return [os.path.realpath(path), st.st_size, st.st_mtime_ns]

        pythons: list[list[object]] = []
        for directory in self.path.split(os.pathsep):
            with contextlib.suppress(OSError), os.scandir(directory or ".") as entries:
                for entry in entries:
                    if PYTHON_NAME.fullmatch(entry.name):
                        with contextlib.suppress(OSError):
                            pythons.append([directory, entry.name, *identity(entry.path)])
        with contextlib.suppress(OSError):
            pythons += [["managed", name] for name in sorted(os.listdir(self.python_dir))]
        uv = identity(self.uv) if self.uv is not None else []
        return json.dumps({"uv": uv, "pythons": pythons})
