"""What comes before an attempt's program starts: its slot's directories made new, its code
checked out from git, its data (job_data.py) and checkpoint (attempt_checkpoints.py) fetched,
and the environment its lock describes (envs.py) taken; and the job's environment variables it
then runs with, that environment's among them, held until the attempt ends.

Apart from runner.py, which holds the attempt's processes: `JobSetup` owns what the steps before
the spawn need and make, and the run asks it (its directory, whether anything comes first, the
environment to spawn with) without reaching into it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from daemon.job import Lease
from daemon.worker import attempt_checkpoints, git_mirror, job_data
from daemon.worker.env_lock import find_lock, has_lock
from daemon.worker.envs import EnvCache, InUse
from daemon.worker.identity import SlotIdentity
from daemon.worker.pool_link import PoolLink
from daemon.worker.scratch import SlotScratch
from daemon.worker.slot_limits import SlotLimits
from storage.base import ObjectStore
from storage.cache import ObjectCache

log = logging.getLogger(__name__)


class JobSetup:
    """One attempt's setup: `prepare` once before its spawn (unless nothing comes first), then
    `release` at its end, however it ended."""

    def __init__(
        self,
        lease: Lease,
        slot: SlotScratch,
        env: dict[str, str],
        *,
        queue: PoolLink,
        store: ObjectStore | None,
        cache: ObjectCache | None,
        envs: EnvCache | None,
        identity: SlotIdentity | None,
        limits: SlotLimits | None,
        mirrors: Path,
        git_protocols: str,
        note: Callable[[str], None],
    ) -> None:
        """`env`: the job's environment (run_types.job_env's); `mirrors`: the worker's git mirrors
        (git_mirror.py); `note`: a line of the pool's in the job's log. The rest as JobRun's."""
        self.lease = lease
        self.slot = slot
        self.env = env  # what its first process gets: VIRTUAL_ENV and PATH added by `prepare`
        self.queue = queue
        self.store = store
        self.cache = cache
        self.envs = envs
        self.identity = identity
        self.limits = limits
        self.mirrors = mirrors
        self.git_protocols = git_protocols  # what a job's repository may be fetched over
        self.note = note
        self.held: InUse | None = None  # the environment it runs in, held till its end

    @property
    def cwd(self) -> Path:
        """Where the job runs: its spec's `cwd`, else its slot's `work` directory (where its project
        is, the directory in it poolctl ran in)."""
        spec = self.lease.spec
        if spec.cwd:
            return Path(spec.cwd)
        return self.slot.work / spec.project["dir"] if spec.project else self.slot.work

    @property
    def dirs(self) -> tuple[Path, ...]:
        """The slot's directories this job uses: `out`, `ckpt`, and `work` unless it runs in a `cwd` of its
        own (a job with an identity has it anyway: it is its HOME), and, with an identity, `tmp`
        (its TMPDIR)."""
        slot = self.slot
        if self.identity is not None:
            return (slot.out, slot.ckpt, slot.work, slot.tmp)
        if self.lease.spec.cwd:
            return (slot.out, slot.ckpt)
        return (slot.out, slot.ckpt, slot.work)

    def fetches(self) -> bool:
        """Whether anything is fetched before the spawn: code, data, or an earlier attempt's
        checkpoint (attempt_checkpoints.restore)."""
        return self._placed() or (self.lease.attempt > 1 and self.store is not None)

    def may_have_lock(self) -> bool:
        """Whether the job runs in a directory of its own (`cwd`) that holds a lock: then its
        environment comes first. (Code placed in its directory is looked at once placed.)"""
        spec = self.lease.spec
        return self.envs is not None and spec.env_from_lock and spec.cwd is not None and has_lock(self.cwd)

    async def prepare(self, lost: Callable[[], bool]) -> None:
        """What comes before the spawn: the slot's directories, the job's code, data and checkpoint,
        and its environment. `lost`: whether the attempt is no longer this worker's."""
        spec = self.lease.spec
        # Empty, real directories for the job, whatever the slot's last job left or did to them
        # (scratch.py); with an identity, owned by it (mode 0700: no other slot's job can look in).
        await self.slot.prepare(self.dirs)
        if spec.git is not None:
            await self._checkout(spec.git)
        await job_data.prepare(
            self.cache, spec, self.slot.work if spec.project else self.cwd, self.note,
            as_cache_owner=self.identity is None,
        )  # fmt: skip
        await attempt_checkpoints.restore(
            self.store, self.queue, self.lease, self.slot.ckpt, identity=self.identity, note=self.note,
            lost=lost,
        )  # fmt: skip
        await self._take_environment()
        if self.identity is not None and not spec.cwd and self._placed():
            # its code, and the directories its inputs were placed in (not the inputs: root's)
            await asyncio.to_thread(self.identity.own_tree, self.slot.work)

    def set_limits_now(self) -> bool:
        """The slot's CPU and memory limits set for the job in the caller's turn too (the fast
        path's: `JobRun.start`): a cgroup made for the job, empty, which setting a limit reclaims
        nothing from. False when they cannot be set: left to `set_limits`, off the loop."""
        if self.limits is not None:
            try:
                self.limits.apply(self.lease.spec.cpus, self.lease.spec.mem)
            except OSError:
                return False
        return True

    async def set_limits(self) -> str:
        """The slot's CPU and memory limits set for the job (slot_limits.py), in a thread: a
        cgroup made and one removed, which the loop does not wait for. "" when they are set (or
        none are enforced), else why not, logged: the worker's fault, not the job's."""
        if self.limits is None:
            return ""
        spec = self.lease.spec
        try:
            await asyncio.to_thread(self.limits.apply, spec.cpus, spec.mem)
        except OSError as exc:
            why = f"this worker could not set the job's CPU and memory limits ({exc.strerror or exc})"
            log.error("job %s attempt %d: %s; handing it back", self.lease.job_id, self.lease.attempt, why)
            return why
        return ""

    def release(self) -> None:
        """The attempt has ended: its environment may be evicted now."""
        if self.held is not None:
            self.held.release()

    def _placed(self) -> bool:
        """Whether code or data is placed in the job's directory before the spawn."""
        spec = self.lease.spec
        return (
            spec.git is not None or spec.snapshot is not None or spec.project is not None or bool(spec.inputs)
        )

    def _lock_dir(self) -> Path | None:
        """Where the job's lock is: its directory, or, for a project job started in a directory
        below the project's top, the nearest above it up to that top (where uv, run there,
        would find it). None: no lock."""
        places = [self.cwd]
        if self.lease.spec.project and not self.lease.spec.cwd:
            places += [p for p in self.cwd.parents if p.is_relative_to(self.slot.work)]
        return next((place for place in places if has_lock(place)), None)

    async def _take_environment(self) -> None:
        """The environment its lock describes (envs.py), built if this worker has not built it
        yet, and held until the attempt ends: VIRTUAL_ENV and PATH name it."""
        if self.envs is None or not self.lease.spec.env_from_lock or (where := self._lock_dir()) is None:
            return
        lock = await asyncio.to_thread(find_lock, where)
        if lock is None:
            self.note("requirements.txt is not hash-pinned: the job runs without an environment of its own")
            return
        self.held = await self.envs.use(lock, self.note)
        self.env.update(self.held.variables(self.env.get("PATH", "")))

    async def _checkout(self, source: Mapping[str, str]) -> None:
        """The job's code: its repository at the exact commit, in the (empty) scratch directory."""
        rev = source.get("commit") or source["ref"]
        commit = await git_mirror.checkout(
            self.mirrors, source["repo"], rev, self.slot.work, self.git_protocols
        )
        self.note(f"git: {source['repo']} at {commit}")
