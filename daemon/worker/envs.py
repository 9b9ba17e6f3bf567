"""The worker's cache of built Python environments: one per lock, built once with uv, shared
read-only by every job that needs it.

A job whose directory holds a lock (`uv.lock` with its `pyproject.toml`, else `pylock.toml`, else
a `requirements.txt` whose every requirement is pinned with a hash) runs in the environment that
lock describes: VIRTUAL_ENV names it and its `bin` comes first on PATH. The environment is found
by its key, the sha256 of the lock's bytes (and the pyproject's, and a `.python-version`), uv and
the Pythons it may build on (as they were when the worker started), the platform and the
worker's index settings: a job whose environment is built costs a readlink and a shared flock,
no uv at all.

Layout under `root` (data_dir/envs):

    envs/<key>            a symlink to built/<key>.<random>: the environment, published. Made in
                          one system call once the build is complete and read-only, so a half-built
                          environment is never seen; removed first when the environment is evicted.
    built/<key>.<random>  the virtual environment, built where it stays (its scripts name their
                          own path), then given to the worker and made read-only (dirs 0755, files
                          without write bits): a job with a slot uid can run it, never change it.
    used/<key>            its LRU stamp (mtime, not atime) holding its size in bytes
    locks/<key>           flock'd exclusively by the one process building it (or making its
                          bytecode). Lock files are never removed: a waiter would hold a lock on
                          a file no longer there, which the next one would not see
    inuse/<key>           flock'd shared by every job using it, for as long as it runs; eviction
                          takes it exclusively without waiting, or leaves the environment alone
    work/<key>.<random>   a build's inputs (the lock's files, copied) and the builder's home and
                          temporary directory: removed after the build
    uv-cache/<uid>        uv's cache, the builder's own. uv hard-links files from it into an
                          environment; sealing gives those inodes to the worker, so a later build
                          cannot change them, and uv copies them instead (the kernel's
                          protected_hardlinks refuses a link to another uid's read-only file)
    python/               the Pythons uv downloads (only with worker_env_python_downloads)
    evict.lock            flock'd by whoever evicts

Two jobs needing one environment wait for one build: one task per key in this process, and the
key's lock file across processes (workers sharing a machine's data directory). Builds run one
at a time, as the builder (a uid of their own when the worker is root: a source build runs the
package's code, which must reach neither the worker nor the jobs), with binary wheels only unless
the operator allows source builds; after each, every process of the builder's uid is killed. The
index, extra indexes and find-links reach uv through its environment, which jobs never see, and
are written nowhere in the environment. A build that fails fails the jobs that wanted it, each
with uv's own error in its log and one sentence; never the worker. The bytecode is made once the
environment is published (BYTECODE below, a speed mechanism behind one switch).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import platform
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from daemon.errors import GpupoolError
from daemon.worker.identity import SlotIdentity

log = logging.getLogger(__name__)

# The files that make a lock, in the order one is looked for; `.python-version` goes with any.
UV_LOCK, PYPROJECT, PYLOCK, REQUIREMENTS, PYTHON_VERSION = (
    "uv.lock",
    "pyproject.toml",
    "pylock.toml",
    "requirements.txt",
    ".python-version",
)
LOCK_NAMES = (UV_LOCK, PYLOCK, REQUIREMENTS)
PYTHON_NAME = re.compile(r"(python|pypy)(3(\.\d+)?t?)?")  # the interpreters' names on PATH
MAX_LOCK_BYTES = 16 * 2**20  # of one lock file: a lock of thousands of packages is a few MB
NO_INDEX = "none"  # worker_env_index_url's value for no index at all (find-links only)
ERROR_LINES = 40  # of uv's output kept for the job's log when a build fails
# What uv gets of the worker's environment besides what the cache sets: the way out to the index.
UV_PASSED_ENV = frozenset(
    {"LANG", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "SSL_CERT_FILE", "SSL_CERT_DIR"}
)
UV_PASSED_ENV |= {name.lower() for name in UV_PASSED_ENV if name.endswith("PROXY")}


class EnvError(GpupoolError):
    """The job's environment could not be had; the attempt fails with this sentence."""


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
    # The speed switch (BYTECODE below): publish an environment before its bytecode is made,
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


@dataclasses.dataclass(frozen=True, slots=True)
class Lock:
    """A job's lock: its kind (the lock file's name) and the bytes of the files a build needs."""

    kind: str
    files: Mapping[str, bytes]

    def digest(self) -> str:
        h = hashlib.sha256(self.kind.encode())
        for name in sorted(self.files):
            h.update(f"\0{name}\0{len(self.files[name])}\0".encode())
            h.update(self.files[name])
        return h.hexdigest()


def has_lock(directory: Path) -> bool:
    """Whether `directory` may hold a lock (a stat per name): a job without one starts at once."""
    return any(os.path.lexists(directory / name) for name in LOCK_NAMES)


def find_lock(directory: Path) -> Lock | None:
    """The lock in `directory`, or None where it has none (a `requirements.txt` that is not
    hash-pinned is none: it does not say exactly what to install). EnvError for one that cannot
    be read. Blocking: run it in a thread."""
    if (lock := _read(directory, UV_LOCK)) is not None:
        pyproject = _read(directory, PYPROJECT)
        if pyproject is None:
            raise EnvError(f"the job's directory has {UV_LOCK} but no {PYPROJECT}, which uv needs with it")
        files = {UV_LOCK: lock, PYPROJECT: pyproject}
        kind = UV_LOCK
    elif (lock := _read(directory, PYLOCK)) is not None:
        files, kind = {PYLOCK: lock}, PYLOCK
    elif (lock := _read(directory, REQUIREMENTS)) is not None and hash_pinned(lock):
        files, kind = {REQUIREMENTS: lock}, REQUIREMENTS
    else:
        return None
    if (version := _read(directory, PYTHON_VERSION)) is not None:
        files[PYTHON_VERSION] = version
    return Lock(kind, files)


def _read(directory: Path, name: str) -> bytes | None:
    """The bytes of the regular file `name` in `directory`, or None where there is none. Never
    through a symlink: the directory is the job's, and its link to a file of the worker's would
    hand that file to the builder and to uv's error messages."""
    try:
        fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise EnvError(f"the job's {name} is a symbolic link: a lock must be a file of its own") from None
        raise EnvError(f"cannot read the job's {name}: {exc.strerror}") from None
    with open(fd, "rb") as file:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise EnvError(f"the job's {name} is not a regular file")
        if st.st_size > MAX_LOCK_BYTES:
            raise EnvError(f"the job's {name} is larger than {MAX_LOCK_BYTES} bytes")
        return file.read(MAX_LOCK_BYTES + 1)


def hash_pinned(text: bytes) -> bool:
    """Whether a requirements file pins every requirement to a version and its hashes, and has no
    options (an index, another file, an editable path: what is installed is the lock's alone)."""
    logical = text.decode(errors="replace").replace("\\\r\n", " ").replace("\\\n", " ")
    requirements = 0
    for raw in logical.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-") or "==" not in line or "--hash=" not in line:
            return False
        requirements += 1
    return requirements > 0


class InUse:
    """A job's hold on an environment: while it is held, no worker evicts it. `release()` once."""

    def __init__(self, key: str, path: Path, fd: int, on_release: Callable[[], None]) -> None:
        self.key = key
        self.path = path  # the virtual environment's real path
        self._fd: int | None = fd
        self._on_release = on_release

    def variables(self, path: str) -> dict[str, str]:
        """What the job's environment gets: VIRTUAL_ENV, and its `bin` first on `path` (PATH)."""
        return {
            "VIRTUAL_ENV": str(self.path),
            "PATH": f"{self.path}/bin:{path}" if path else f"{self.path}/bin",
        }

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # lets go of the shared flock
            self._fd = None
            self._on_release()


def find_uv() -> str | None:
    """uv: beside this Python (the venv gpupool is installed in, which depends on it), else on PATH."""
    beside = Path(sys.executable).parent / "uv"
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("uv")


class EnvCache:
    """A worker's environments, kept under `root` (its data_dir/envs) as `settings` say, built
    with `uv` as `builder` (None: the worker's own uid); `sweep` kills every process of the
    builder's uid (the spawner's), after each build. `open()` (in a thread) and `start()`, then
    `close()`. `builds` counts the builds this process ran (tests count them)."""

    def __init__(
        self,
        root: Path,
        settings: EnvSettings,
        *,
        builder: SlotIdentity | None = None,
        sweep: Callable[[SlotIdentity], object] | None = None,
        uv: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.root = Path(root)
        self.settings = settings
        self.builder = builder
        self._sweep = sweep
        self.uv = uv or find_uv()
        self._path = (env if env is not None else os.environ).get("PATH", os.defpath)
        self._passed = {k: v for k, v in os.environ.items() if k in UV_PASSED_ENV}
        self.builds = 0
        self._links = self.root / "envs"
        self._built = self.root / "built"
        self._used = self.root / "used"
        self._locks = self.root / "locks"
        self._inuse = self.root / "inuse"
        self._work = self.root / "work"
        self._uv_cache = self.root / "uv-cache"
        self._python = self.root / "python"
        self._inflight: dict[str, asyncio.Task[Path]] = {}
        self._compiling: set[asyncio.Task[None]] = set()  # bytecode being made (BYTECODE below)
        self._one_build = asyncio.Lock()  # the builder's uid is swept after each: one at a time
        self._pythons: str | None = None  # uv and the Pythons it may build on (_toolchain)
        self._over = False  # the last eviction left the cache over its budget (environments in use)
        self._evicting: asyncio.Task[None] | None = None  # one started when a job let go of one

    # -- the directories ------------------------------------------------------------------------

    def open(self) -> None:
        """Make the directories, each as reachable as it must be (the jobs pass through built/,
        the builder through work/ and uv-cache/, nobody else lists anything), and remove what a
        build that died left. Blocking: run it in a thread."""
        for path, mode in (
            (self.root, 0o711),
            (self._built, 0o711),
            (self._work, 0o711),
            (self._uv_cache, 0o711),
            (self._python, 0o755),
            (self._links, 0o700),
            (self._used, 0o700),
            (self._locks, 0o700),
            (self._inuse, 0o700),
        ):
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(mode)
        if self.builder is not None:  # uv downloads Pythons as the builder, who must write there
            os.chown(self._python, self.builder.uid, self.builder.gid)
        self._remove_dead_builds()

    def _remove_dead_builds(self) -> None:
        """Builds no process is making (their key's lock is free) that were never published."""
        published = {os.readlink(link.path) for link in os.scandir(self._links) if link.is_symlink()}
        for parent in (self._built, self._work):
            for entry in os.scandir(parent):
                key = entry.name.partition(".")[0]
                if f"../built/{entry.name}" in published or not entry.name.count("."):
                    continue
                with self._lock_file(self._locks / key) as fd:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue  # being built now, by another worker
                    _remove_tree(Path(entry.path))

    @staticmethod
    @contextlib.contextmanager
    def _lock_file(path: Path) -> Iterator[int]:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            yield fd
        finally:
            os.close(fd)

    async def start(self) -> None:
        """End what a worker that died left running as the builder's uid (a build in progress)."""
        if self.builder is not None and self._sweep is not None:
            await _maybe_await(self._sweep(self.builder))

    async def close(self) -> None:
        """Stop the builds still running (their jobs have all gone)."""
        tasks = [
            *self._inflight.values(),
            *self._compiling,
            *([self._evicting] if self._evicting is not None else []),
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- a job's environment --------------------------------------------------------------------

    async def key(self, lock: Lock) -> str:
        """The environment's name: what it is built from, with, and for."""
        if self._pythons is None:
            self._pythons = await asyncio.to_thread(self._toolchain)
        described = {
            "lock": lock.digest(),
            "toolchain": self._pythons,
            "platform": [sys.platform, platform.machine(), *platform.libc_ver()],
            "settings": dataclasses.asdict(
                dataclasses.replace(self.settings, budget_bytes=0, bytecode_later=True)
            ),
        }
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()

    async def use(self, lock: Lock, note: Callable[[str], None]) -> InUse:
        """The environment of `lock`, held for the caller until it calls `release()`: found by
        its key when built (no uv runs), else built, once, however many jobs wait for it. `note`
        tells the job's log which, and, when the build fails, uv's own words (then BuildFailed)."""
        if self.uv is None:
            raise EnvError(
                f"the job's directory has {lock.kind}, and this worker has no uv to build its "
                "environment (install gpupool with its dependencies, or enqueue with --no-env)"
            )
        key = await self.key(lock)
        fd = os.open(self._inuse / key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            await _flock(fd, fcntl.LOCK_SH)  # an eviction of it under way ends first
            path = self._published(key)
            if path is not None:
                self._touch(key)
                note(f"environment {key[:12]} from {lock.kind} (built before)")
            else:
                started = time.monotonic()
                path = await self._shared_build(key, lock)
                note(f"environment {key[:12]} built from {lock.kind} in {time.monotonic() - started:.1f} s")
        except BuildFailed as exc:
            os.close(fd)
            for line in exc.output:
                note(f"uv: {line}")
            raise
        except BaseException:
            os.close(fd)
            raise
        return InUse(key, path, fd, self._released)

    def _published(self, key: str) -> Path | None:
        """The environment published under `key` (its real path), or None."""
        try:
            return self._built / Path(os.readlink(self._links / key)).name
        except FileNotFoundError:
            return None

    def _released(self) -> None:
        if self._over and (self._evicting is None or self._evicting.done()):
            # an eviction skipped environments in use: the one let go may be free now
            self._evicting = asyncio.get_running_loop().create_task(self.evict())

    async def _shared_build(self, key: str, lock: Lock) -> Path:
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._build(key, lock))
            self._inflight[key] = task
            task.add_done_callback(lambda _: self._inflight.pop(key, None))
        # Shielded: one job giving up must not cancel the build the others wait for.
        return await asyncio.shield(task)

    # -- building -------------------------------------------------------------------------------

    async def _build(self, key: str, lock: Lock) -> Path:
        async with self._one_build:
            fd = os.open(self._locks / key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                await _flock(fd, fcntl.LOCK_EX)
                if (found := self._published(key)) is not None:  # another worker built it meanwhile
                    self._touch(key)
                    return found
                name = f"{key}.{secrets.token_hex(4)}"
                work, target = self._work / name, self._built / name
                try:
                    await asyncio.to_thread(self._lay_out, work, target, lock)
                    await self._run_uv(work, target, lock)
                    size = await asyncio.to_thread(self._seal, target)
                    self.builds += 1
                    (self._used / key).write_text(str(size))
                    os.symlink(f"../built/{name}", self._links / key)  # published
                    if self.settings.bytecode_later:
                        task = asyncio.ensure_future(self._make_bytecode(key, target))
                        self._compiling.add(task)
                        task.add_done_callback(self._compiling.discard)
                except BaseException:
                    await asyncio.to_thread(_remove_tree, target)
                    raise
                finally:
                    await asyncio.to_thread(_remove_tree, work)
            finally:
                os.close(fd)
        await self.evict()
        return target

    def _lay_out(self, work: Path, target: Path | None, lock: Lock | None) -> None:
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
        cache = self._uv_cache / str(self.builder.uid if self.builder is not None else os.geteuid())
        cache.mkdir(mode=0o700, exist_ok=True)
        if self.builder is not None:
            uid, gid = self.builder.uid, self.builder.gid
            for path in (work / "home", work / "tmp", cache, *([target] if target else [])):
                os.chown(path, uid, gid)

    def _uv_environment(self, work: Path) -> dict[str, str]:
        uid = self.builder.uid if self.builder is not None else os.geteuid()
        return {
            **self._passed,
            **self.settings.uv_env(),
            "PATH": self._path,
            "HOME": str(work / "home"),
            "TMPDIR": str(work / "tmp"),
            "UV_CACHE_DIR": str(self._uv_cache / str(uid)),
            "UV_PYTHON_INSTALL_DIR": str(self._python),
            "UV_NO_CONFIG": "1",  # neither the worker's uv.toml nor the user's: these settings only
            "UV_NO_PROGRESS": "1",
            # Hard-linked from uv's cache where uv can (a copy writes every file of the
            # environment again); copied where a sealed environment holds the cache's inode.
            "UV_LINK_MODE": "hardlink",
            # The jobs cannot write .pyc files into the environment: made once, by the builder.
            "UV_COMPILE_BYTECODE": "0" if self.settings.bytecode_later else "1",
        }

    def _commands(self, work: Path, target: Path, lock: Lock) -> list[list[str]]:
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

    async def _run_uv(self, work: Path, target: Path, lock: Lock) -> None:
        env = self._uv_environment(work)
        env["UV_PROJECT_ENVIRONMENT"] = str(target)
        if version := lock.files.get(PYTHON_VERSION, b"").decode(errors="replace").strip().split("\n")[0]:
            env["UV_PYTHON"] = version  # (what uv would read there, but for UV_NO_CONFIG)
        try:
            for argv in self._commands(work, target, lock):
                code, output = await self._run(argv, env, cwd=work / "project")
                if code != 0:
                    raise BuildFailed(self._why(lock, code, output), output[-ERROR_LINES:])
        finally:
            if self.builder is not None and self._sweep is not None:
                await _maybe_await(self._sweep(self.builder))

    def _why(self, lock: Lock, code: int, output: Sequence[str]) -> str:
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

    async def _run(self, argv: list[str], env: Mapping[str, str], cwd: Path) -> tuple[int, list[str]]:
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

    def _seal(self, target: Path) -> int:
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

    def _toolchain(self) -> str:
        """uv and the Pythons it may build on, part of every key: uv's binary and each
        interpreter on PATH and among those uv downloaded, by real path, size and mtime. Looked
        at once per worker, without running them (uv would run each, most of a second where
        pyenv's shims are on PATH). Blocking."""

        def identity(path: str) -> list[object]:
            st = os.stat(path)
            return [os.path.realpath(path), st.st_size, st.st_mtime_ns]

        pythons: list[list[object]] = []
        for directory in self._path.split(os.pathsep):
            with contextlib.suppress(OSError), os.scandir(directory or ".") as entries:
                for entry in entries:
                    if PYTHON_NAME.fullmatch(entry.name):
                        with contextlib.suppress(OSError):
                            pythons.append([directory, entry.name, *identity(entry.path)])
        with contextlib.suppress(OSError):
            pythons += [["managed", name] for name in sorted(os.listdir(self._python))]
        uv = identity(self.uv) if self.uv is not None else []
        return json.dumps({"uv": uv, "pythons": pythons})

    # -- BYTECODE: made after the environment is published --------------------------------------
    # A speed mechanism behind EnvSettings.bytecode_later. A job cannot write .pyc files into its
    # read-only environment, so they are made for it; made in the build, they delay the first job
    # by the compiling of every module (uv compiles them all; a laptop's first run compiles those
    # it imports, as it imports them). Made after, the first jobs compile what they import in
    # memory, as that first run would, and the rest find them made.

    # compileall on every core, but only where a core is idle (SCHED_IDLE, which its workers
    # inherit): the first jobs, importing what they need, must not wait for it.
    COMPILE_WHEN_IDLE = (
        "import os, runpy, sys; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); "
        "sys.argv[1:1] = ['-q', '-j', '0']; "
        "runpy.run_module('compileall', run_name='__main__', alter_sys=True)"
    )

    async def settled(self) -> None:
        """Wait for the bytecode being made (tests, benchmarks)."""
        while self._compiling:
            await asyncio.gather(*self._compiling, return_exceptions=True)

    async def _make_bytecode(self, key: str, target: Path) -> None:
        """Compile the environment's modules as the builder, into a tree of its own (Python's
        pycache_prefix: the environment is the worker's, read-only), then, its processes gone,
        give each file to the worker and move it into its `__pycache__`. Held in use meanwhile;
        after the other builds, one at a time (each sweeps the builder's uid)."""
        fd = os.open(self._inuse / key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        building = os.open(self._locks / key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        work = self._work / f"{key}.{secrets.token_hex(4)}"
        try:
            await _flock(fd, fcntl.LOCK_SH)
            async with self._one_build:
                await _flock(building, fcntl.LOCK_EX)  # (its work directory is then no dead build's)
                if self._published(key) != target:
                    return  # evicted meanwhile
                await asyncio.to_thread(self._lay_out, work, work / "pyc", None)
                sites = await asyncio.to_thread(
                    lambda: [str(p) for p in target.glob("lib/python*/site-packages")]
                )
                python = [str(target / "bin" / "python"), "-I", "-S", "-X", f"pycache_prefix={work / 'pyc'}"]
                argv = [*python, "-c", self.COMPILE_WHEN_IDLE, *sites]
                try:
                    # (a module that does not compile, as some packages ship, leaves it out)
                    await self._run(argv, self._uv_environment(work), work)
                finally:
                    if self.builder is not None and self._sweep is not None:
                        await _maybe_await(self._sweep(self.builder))
                added = await asyncio.to_thread(self._place_bytecode, work / "pyc", target)
                with contextlib.suppress(FileNotFoundError, ValueError):
                    stamp = self._used / key
                    stamp.write_text(str(int(stamp.read_text()) + added))
        except (OSError, EnvError) as exc:  # the environment works without: its jobs compile
            log.warning("envs: no bytecode made for %s: %s", key[:12], exc)
        finally:
            os.close(fd)
            await asyncio.to_thread(_remove_tree, work)
            os.close(building)

    def _place_bytecode(self, made: Path, target: Path) -> int:
        """Move the .pyc files `made` holds for `target` into its `__pycache__` directories, the
        worker's and read-only like the rest of it. Only plain files of the builder's with one
        link: a hard link to another file would have its mode changed. Bytes moved. Blocking."""
        builder = self.builder.uid if self.builder is not None else os.geteuid()
        uid, gid = os.geteuid(), os.getegid()
        mirror = made / target.relative_to(target.anchor)
        added = 0
        for top, _, files in os.walk(mirror):
            source_dir = target / Path(top).relative_to(mirror)
            if not source_dir.is_dir() or source_dir.is_symlink():
                continue
            for name in files:
                path = os.path.join(top, name)
                st = os.lstat(path)
                if not (name.endswith(".pyc") and stat.S_ISREG(st.st_mode)):
                    continue
                if st.st_uid != builder or st.st_nlink != 1:
                    continue
                cache = source_dir / "__pycache__"
                if not cache.is_dir():
                    cache.mkdir()
                    cache.chmod(0o755)
                if os.path.lexists(cache / name):
                    continue
                os.chown(path, uid, gid)
                os.chmod(path, 0o444)
                os.rename(path, cache / name)
                added += st.st_size
        return added

    # -- eviction -------------------------------------------------------------------------------

    def _touch(self, key: str) -> None:
        now = time.time_ns()
        with contextlib.suppress(FileNotFoundError):
            os.utime(self._used / key, ns=(now, now))

    def size(self) -> int:
        """Bytes of the environments built (their sizes as measured when each was sealed)."""
        return sum(int(p.read_text() or 0) for p in self._used.iterdir())

    async def evict(self) -> None:
        """Evict least recently used environments, never one a job uses, until the cache fits
        its budget."""
        await asyncio.to_thread(self._evict)

    def _evict(self) -> None:
        with self._lock_file(self.root / "evict.lock") as evicting:
            fcntl.flock(evicting, fcntl.LOCK_EX)
            entries: list[tuple[int, str, int]] = []
            for stamp in os.scandir(self._used):
                with contextlib.suppress(FileNotFoundError, ValueError):
                    entries.append((stamp.stat().st_mtime_ns, stamp.name, int(Path(stamp.path).read_text())))
            total = sum(size for _, _, size in entries)
            for _, key, size in sorted(entries):
                if total <= self.settings.budget_bytes:
                    break
                with self._lock_file(self._inuse / key) as fd:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue  # a job uses it (or one is about to)
                    try:
                        built = self._links / os.readlink(self._links / key)
                    except FileNotFoundError:
                        built = None
                    (self._links / key).unlink(missing_ok=True)  # unpublished: no job finds it now
                    (self._used / key).unlink(missing_ok=True)
                log.info(
                    "envs: evicting %s (%d bytes) to stay under %d bytes",
                    key,
                    size,
                    self.settings.budget_bytes,
                )
                if built is not None:
                    _remove_tree(built)
                total -= size
            self._over = total > self.settings.budget_bytes
            if self._over:
                log.info(
                    "envs: %d bytes, over the budget of %d: the rest are in use",
                    total,
                    self.settings.budget_bytes,
                )


def _remove_tree(path: Path) -> None:
    """Remove `path` and all under it. A worker that is not root owns the read-only directories
    it sealed, and must make them writable first (root's writes pass any mode)."""
    if not os.path.lexists(path):
        return
    if os.geteuid() != 0:
        for top, _, _ in os.walk(path):
            with contextlib.suppress(OSError):
                os.chmod(top, 0o755)  # noqa: S103 - about to be removed
    shutil.rmtree(path, ignore_errors=True)


async def _maybe_await(value: object) -> None:
    if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
        await value


async def _flock(fd: int, op: int) -> None:
    """Take a flock on `fd` (LOCK_SH or LOCK_EX) without blocking the event loop. If the caller
    is cancelled while a thread waits for it, the thread's lock is let go once it comes (the
    caller closes `fd`, which lets go of it)."""
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    await asyncio.shield(asyncio.get_running_loop().run_in_executor(None, fcntl.flock, fd, op))
