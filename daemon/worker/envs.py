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
environment is published (env_bytecode.py, a speed mechanism behind one switch).

What a lock is: env_lock.py. Running uv as the builder, and sealing what it built: env_build.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import platform
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from daemon.worker.env_build import Builder, BuildFailed, EnvSettings
from daemon.worker.env_bytecode import make_bytecode
from daemon.worker.env_lock import EnvError, Lock
from daemon.worker.identity import SlotIdentity

log = logging.getLogger(__name__)


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
        self.builds = 0
        self._links = self.root / "envs"
        self._built = self.root / "built"
        self._used = self.root / "used"
        self._locks = self.root / "locks"
        self._inuse = self.root / "inuse"
        self._work = self.root / "work"
        self._uv_cache = self.root / "uv-cache"
        self._python = self.root / "python"
        self.uv_run = Builder(
            settings,
            uv_cache=self._uv_cache,
            python_dir=self._python,
            builder=builder,
            sweep=sweep,
            uv=uv,
            env=env,
        )
        self.uv = self.uv_run.uv
        self._inflight: dict[str, asyncio.Task[Path]] = {}
        self._compiling: set[asyncio.Task[None]] = set()  # bytecode being made (env_bytecode.py)
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
        await self.uv_run.sweep()

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
            self._pythons = await asyncio.to_thread(self.uv_run.toolchain)
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
                    await asyncio.to_thread(self.uv_run.lay_out, work, target, lock)
                    await self.uv_run.run_uv(work, target, lock)
                    size = await asyncio.to_thread(self.uv_run.seal, target)
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

    # -- bytecode, made after the environment is published (env_bytecode.py) ----------------

    async def settled(self) -> None:
        """Wait for the bytecode being made (tests, benchmarks)."""
        while self._compiling:
            await asyncio.gather(*self._compiling, return_exceptions=True)

    async def _make_bytecode(self, key: str, target: Path) -> None:
        """The environment's bytecode, made (env_bytecode.py) and counted in its size. Held in
        use meanwhile; after the other builds, one at a time (each sweeps the builder's uid)."""
        fd = os.open(self._inuse / key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        building = os.open(self._locks / key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        work = self._work / f"{key}.{secrets.token_hex(4)}"
        try:
            await _flock(fd, fcntl.LOCK_SH)
            async with self._one_build:
                await _flock(building, fcntl.LOCK_EX)  # (its work directory is then no dead build's)
                if self._published(key) != target:
                    return  # evicted meanwhile
                added = await make_bytecode(self.uv_run, target, work)
                with contextlib.suppress(FileNotFoundError, ValueError):
                    stamp = self._used / key
                    stamp.write_text(str(int(stamp.read_text()) + added))
        except (OSError, EnvError) as exc:  # the environment works without: its jobs compile
            log.warning("envs: no bytecode made for %s: %s", key[:12], exc)
        finally:
            os.close(fd)
            await asyncio.to_thread(_remove_tree, work)
            os.close(building)

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
