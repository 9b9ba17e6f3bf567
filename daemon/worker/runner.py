"""One attempt of a job as processes: start it, stream its output, stop it, make sure it is gone.

The job's argv runs without a shell, in a new session (so its process group is its own and one
`killpg` reaches every process it starts), started by the worker's spawner (spawn.py); if the worker dies,
orphan_guard.py kills its jobs. Its directory is the spec's `cwd`, or its slot's scratch directory
`work` (next to `out`, the GPUPOOL_OUTPUT directory): empty when the job starts, emptied when it
ends (scratch.py).

Output (stdout and stderr merged) streams to the job's log as it comes (job_output.py); a refused
log write means the attempt is no longer this worker's, and the job is killed at once.

A tty job (`poolctl shell`) runs on a terminal instead (terminal.py): its output is the
terminal's, read the same way, and it is stopped as a timeout stops a job once no client has sent
it input for its idle limit.

Stopping: a cancel, a timeout, an idle shell or a drain sends SIGTERM (or the job's stop signal)
to the whole process group and SIGKILL after `kill_grace`; a lost lease sends SIGKILL at once.
When the first process has ended, every process left in the job's session or seen among its
descendants is SIGKILLed, and where NVML answers, a GPU on which a process of the job still holds
memory is reported dirty.

Its parts that stand alone are modules of their own: what comes before its program starts (its
directories, code, data, checkpoint, limits and environment: job_setup.py), its checkpoint at
either end (attempt_checkpoints.py), its process tree sampled and what it left (job_tree.py), its
stop signals (job_signals.py), and what its end records (attempt_outcome.py); what a run is and
what its end says (Ending, RunResult, the Run protocol, the job's environment), which every worker
module speaks, is run_types.py's. Here: its processes' life, and which Ending it had.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from daemon.aio import cancel_and_wait
from daemon.errors import GpupoolError
from daemon.git import ANY_PROTOCOL
from daemon.job import JobState, Lease, Outcome
from daemon.worker import (
    attempt_checkpoints,
    attempt_outcome,
    checkpoints,
    job_data,
    leftovers,
    scratch,
    spawn,
)
from daemon.worker.cgroups import SlotCgroup
from daemon.worker.envs import EnvCache
from daemon.worker.gpu_fault_end import FaultCheck, gpu_fault_end
from daemon.worker.gpus import GpuInfo, GpuProbe
from daemon.worker.identity import SlotIdentity
from daemon.worker.job_output import JobOutput
from daemon.worker.job_setup import JobSetup
from daemon.worker.job_signals import StopSignals
from daemon.worker.job_tree import JobTree
from daemon.worker.nvml_asks import GpuAsks
from daemon.worker.orphan_guard import OrphanGuard
from daemon.worker.pool_link import PoolLink
from daemon.worker.run_types import Ending, RunResult, describe_exit, job_env
from daemon.worker.slot_limits import SlotLimits, Usage
from daemon.worker.terminal import Terminal
from storage.base import ObjectStore
from storage.cache import ObjectCache

log = logging.getLogger(__name__)

FIRST_SAMPLE_SECONDS = 0.05  # a job that ends sooner is not sampled (a scan is not free)
LEFTOVERS_SECONDS = 5.0  # how long killed leftovers of a job may take to die


class JobRun:
    """One attempt. `run()` once; `cancel()`, `hand_back()` and `lose()` may come at any time."""

    def __init__(
        self,
        queue: PoolLink,
        lease: Lease,
        *,
        data_dir: Path,
        gpus: Sequence[GpuInfo] = (),
        env: Mapping[str, str] | None = None,
        kill_grace: float = 10.0,
        shell_idle_limit: float = 3600.0,
        probe: GpuProbe | None = None,
        guard: OrphanGuard | None = None,
        spawner: spawn.Spawner,
        store: ObjectStore | None = None,
        cache: ObjectCache | None = None,
        envs: EnvCache | None = None,
        slot_dir: Path | None = None,
        slot: scratch.SlotScratch | None = None,
        identity: SlotIdentity | None = None,
        cgroup: SlotCgroup | None = None,
        limits: SlotLimits | None = None,
        git_protocols: str = ANY_PROTOCOL,
        eager: bool = True,
        on_slot_free: Callable[[], None] | None = None,
        on_exit: Callable[[], None] | None = None,
        gpu_fault: FaultCheck | None = None,
        gpu_asks: GpuAsks[set[int]] | None = None,
    ) -> None:
        """`slot` is the scratch directories of the slot it runs on (scratch.py; default: those
        under `slot_dir`, or `data_dir/slot`). `store` receives the artifacts; `cache` fetches the
        snapshot and inputs (None: a worker without an object store; jobs with data then fail
        saying so). `envs`: the worker's environments, one of which the job runs in when its
        directory holds a lock (envs.py; None: none does). `spawner` starts, reaps and kills its
        processes. `identity`: the uid the job runs as (identity.py; None: the worker's own).
        `cgroup`: the slot's (cgroups.py), which holds all the job starts (None: found through
        /proc at the end). `limits`: the slot's CPU and memory limits (slot_limits.py), which hold
        it to its --cpus and --mem (None: not enforced). `eager`: `start` may spawn the job in its
        caller's turn; `on_slot_free` is called when the slot may take its next job before this
        one's end is recorded (see `_hand_over`; None: never). Both are the fast path's
        (worker/fast_path.py). `on_exit` is called as soon as its first process has ended (an
        agent tells its server: agent.py). `gpu_fault` says, as a job that failed by itself ends,
        whether its GPUs showed a health fault meanwhile (health_watch.py; None: not watched).
        `gpu_asks`: the worker's asks of `probe` (nvml_asks.py), shared by its runs' end checks,
        so that a GPU whose NVML hangs holds one thread however many jobs end on it (None: this
        run's own)."""
        self.queue = queue
        self.store = store
        self.lease = lease
        self.gpus = tuple(gpus)
        self._signals = StopSignals(lease.spec, kill_grace)
        # A tty job's (terminal.py): its own, up to the worker's, which is a cap (a shell with a
        # limit of its own past it would keep its GPUs from others, forgotten, as long as it liked).
        self.idle_limit = min(lease.spec.idle_limit or shell_idle_limit, shell_idle_limit)
        self.terminal: Terminal | None = None  # a tty job's, from its spawn to its end
        self.probe = probe
        self._gpu_asks: GpuAsks[set[int]] = gpu_asks or GpuAsks("gpupool-gpu-check")
        self.guard = guard
        self.spawner = spawner
        owner = (identity.uid, identity.gid) if identity is not None else None
        self.slot = slot or scratch.SlotScratch(slot_dir or data_dir / "slot", owner)
        self.output_dir = self.slot.out
        self.checkpoint_dir = self.slot.ckpt
        self._saver = (
            checkpoints.Saver(store, queue, lease, self.checkpoint_dir) if store is not None else None
        )
        self._saving: asyncio.Task[None] | None = None  # the periodic saves (spec.checkpoint_every)
        self.identity = identity
        self.cgroup = cgroup
        self.limits = limits
        self._usage: Usage | None = None  # what it did under its limits, read at its end
        self.eager = eager  # `start` may spawn in its caller's turn (worker/fast_path.py)
        self.ending: Ending | None = None
        self.stopped_why = ""  # what stopped it, when something did (`ending`'s sentence)
        self._by_policy = False  # handed back by the pool's GPU policies (RunResult.by_policy)
        self._proc: spawn.Child | None = None
        self._started = 0.0  # time.time() when it started
        self._start_error: Exception | None = None  # why `start` could not spawn it: `run` tells
        self._killer: asyncio.Task[None] | None = None
        self._tree = JobTree(f"rss {lease.job_id}")  # its processes: RSS and descendants
        self.output = JobOutput(queue, lease, self.lose)
        home, tmp = (self.slot.work, self.slot.tmp) if identity is not None else (None, None)
        job_vars = job_env(os.environ if env is None else env, lease, self.gpus, home, tmp)
        job_vars["GPUPOOL_OUTPUT"] = str(self.output_dir)
        job_vars["GPUPOOL_CHECKPOINT_DIR"] = str(self.checkpoint_dir)
        self.setup = JobSetup(
            lease, self.slot, job_vars, queue=queue, store=store, cache=cache, envs=envs, identity=identity,
            limits=limits, mirrors=data_dir / "git", git_protocols=git_protocols, note=self.output.note,
        )  # fmt: skip
        self.on_slot_free = on_slot_free
        self.on_exit = on_exit or (lambda: None)
        self._gpu_fault = gpu_fault
        self._fault = ""  # a fault of its GPUs its outcome's detail names (let_finish)
        self._handed_over = False  # its directories are the slot's next job's already

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def first_process(self) -> spawn.Child | None:
        """The job's first process once spawned (a command run inside the job ends with it)."""
        return self._proc

    @property
    def env(self) -> dict[str, str]:
        """The job's environment, as its first process got it (a copy)."""
        return dict(self.setup.env)

    # -- stopping ---------------------------------------------------------------------------------

    def cancel(self) -> None:
        """The user cancelled: SIGTERM, SIGKILL after the grace; recorded as CANCELLED."""
        self._stop(Ending.CANCELLED, "cancelled")

    def hand_back(
        self, now: bool = False, why: str = "the worker is stopping", by_policy: bool = False
    ) -> None:
        """Stop the job (at once with `now`) so the attempt can go back to the front of its queue:
        the worker is stopping, or the job was requeued, or (`by_policy`) the pool's GPU policies
        ask, a loss towards max_attempts. A tty job ends instead, FAILED: its shell
        is its user's terminal, which a requeue would leave running elsewhere with nobody at it
        (holding its GPUs until its idle limit), while the user's poolctl saw only an end."""
        self._stop(*self._handing_back(why, by_policy), now=now)

    def _handing_back(self, why: str, by_policy: bool) -> tuple[Ending, str]:
        """The ending a hand-back asks, and why: STOPPED for a tty job (see `hand_back`)."""
        if self.lease.spec.tty:
            return Ending.STOPPED, f"{why}; a shell is not requeued"
        self._by_policy = self._by_policy or (by_policy and self.ending is None)
        return Ending.HANDED_BACK, why

    def note(self, text: str) -> None:
        self.output.note(text)

    def lose(self, why: str) -> None:
        """The attempt is no longer this worker's: SIGKILL at once, record nothing (its log
        included: the fenced writes would be refused, or Redis is out of reach). Once the job's
        process has ended this changes nothing: how it ended is its outcome, which the fenced
        complete then accepts or refuses."""
        if self._ended():
            return
        self._stop(Ending.LOST, why, now=True)
        self.output.closed = True

    def _ended(self) -> bool:
        return self._proc is not None and self._proc.returncode is not None

    @property
    def exited(self) -> bool:
        return self._ended()

    @property
    def stopping(self) -> bool:
        return self.ending is not None or self._ended()

    def _stop(self, ending: Ending, why: str, now: bool = False) -> None:
        if self._ended():
            return  # how it ended is decided
        first = self.ending is None
        if first or ending is Ending.LOST:
            self.ending, self.stopped_why = ending, why
        if self._proc is None:
            return  # not started yet: run() applies the ending
        if now:
            self.output.note(f"{why}: killing the job now")
            self._signal(signal.SIGKILL)
        elif self._killer is None:  # not yet asked: a stop noted before the start is sent now
            sig, grace = self._signals.stop_signal, self._signals.stop_grace
            self.output.note(f"{why}: stopping the job ({sig.name}, then SIGKILL after {grace:g} s)")
            self._killer = asyncio.create_task(self._terminate(), name=f"stop {self.lease.job_id}")

    async def _terminate(self) -> None:
        if self._proc is not None:
            await self._signals.terminate(self._proc.pid)

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc is not None:
            self._signals.send(self._proc.pid, sig)

    def _timeout(self) -> None:
        self._stop(Ending.TIMED_OUT, f"timed out after {self.lease.spec.timeout:g} s")

    def _idle(self, limit: float) -> None:
        self._stop(Ending.IDLE, f"ended: no input for {limit:g} s")

    # -- running ----------------------------------------------------------------------------------

    async def run(self) -> RunResult:
        """Run the attempt to its end and say how it ended. If cancelled itself, the job's
        processes are killed before the CancelledError goes on. Then `tidy()`, however it ended."""
        try:
            return await self._run()
        finally:  # the periodic saves end with the attempt however it ends, before the slot's tidying
            if self._saving is not None:
                await cancel_and_wait(self._saving)
            self.setup.release()

    async def tidy(self) -> None:
        """The slot's directories back to a new one's state for its next job, which waits for
        this (scratch.py): the attempt is over, nothing of it runs."""
        if not self._handed_over:
            await self.slot.finish(self.setup.dirs)

    @property
    def cwd(self) -> Path:
        """Where the job runs (JobSetup.cwd)."""
        return self.setup.cwd

    def start(self) -> None:
        """Spawn the job now, in the caller's turn (the one that freed its slot, or got its claim),
        when nothing has to come first: no code, data or checkpoint to fetch, and its slot's
        directories free and surely as new (scratch.py `take`). It saves a turn of the loop
        between one job's end and the next one's start, most of a short job's wait. `run` then
        supervises it (or, if the spawn failed, records why); else `run` prepares and spawns."""
        if not self.eager or self.ending is not None or self.setup.fetches() or self.setup.may_have_lock():
            return
        if not self.setup.set_limits_now():
            return  # `run` tries again off the loop, and hands the attempt back if it fails there too
        if not self.slot.take(self.setup.dirs):
            return
        self._started = time.time()
        try:
            self._spawn()
        except Exception as exc:  # noqa: BLE001 - the attempt's own: `run` records it, or raises it there
            self._start_error = exc

    def _spawn(self) -> None:
        """The job's first process, its output read and its process group watched by the guard."""
        minors = [g.minor for g in self.gpus]
        owner = self.identity.uid if self.identity is not None else None
        terminal = Terminal(self.idle_limit, self._idle, owner) if self.lease.spec.tty else None
        try:
            self._proc = self.spawner.spawn(
                self.lease.spec.argv,
                cwd=self.cwd,
                env=self.setup.env,
                identity=self.identity,
                cgroup=self.cgroup,
                gpus=None if None in minors else {m for m in minors if m is not None},
                terminal=terminal.slave if terminal is not None else None,
                joins=self.limits.joins() if self.limits is not None else (),
            )
        except BaseException:
            if terminal is not None:
                terminal.close()
            raise
        if terminal is None:
            self.output.read_from(self._proc.output)
        else:
            terminal.close_slave()
            terminal.hold = self.output.hold
            self.output.read_from(terminal.output_fd(), terminal.took)
            self.terminal = terminal
        if self.guard is not None:
            self.guard.watch(self._proc.pid, self.lease.id)

    async def _run(self) -> RunResult:
        spec = self.lease.spec
        if isinstance(self._start_error, OSError | GpupoolError):
            return await self._not_started(self._start_error, self.cwd, self._started)
        if self._start_error is not None:  # a bug: the attempt's task fails, not its caller's
            raise self._start_error
        if self._proc is None:
            self._started = time.time()
            try:
                await self.setup.prepare(lambda: self.ending is Ending.LOST)
                if self.ending is Ending.LOST:  # lost while its data came: it must not start at all
                    return RunResult(Ending.LOST, None)
                if not await self._set_limits():
                    return RunResult(Ending.HANDED_BACK, None, by_policy=True)
                self._spawn()
            except (OSError, GpupoolError) as exc:
                return await self._not_started(exc, self.cwd, self._started)
            if self.ending is not None:  # stopped while it was being prepared
                self._stop(self.ending, "stopped before it started", now=self.ending is not Ending.CANCELLED)
        assert self._proc is not None
        pgid, started = self._proc.pid, self._started
        if spec.checkpoint_every and self._saver is not None:
            self._saving = asyncio.create_task(
                self._saver.every(spec.checkpoint_every), name=f"checkpoints of {self.lease.job_id}"
            )
        result = await self._supervise(pgid, started)
        if self._proc.start_error is not None:  # it ended without running its program
            return await self._not_started(self._proc.start_error, self.cwd, started)
        return result

    async def _set_limits(self) -> bool:
        """The slot's CPU and memory limits set for the job (JobSetup.set_limits). One that cannot
        be set is the worker's fault, not the job's: False, for the attempt to be handed back, as a
        loss towards max_attempts (a worker that can never set them would otherwise take the job
        from the front of its queue again and again)."""
        if not (why := await self.setup.set_limits()):
            return True
        self._stop(Ending.HANDED_BACK, why)
        self.output.note(f"{why}: the job goes back to its queue")
        await self.output.flush()
        return False

    async def _not_started(self, exc: OSError | GpupoolError, cwd: Path, started: float) -> RunResult:
        """The job could not start (its data, its program, its directory): EXITED, saying why."""
        detail = (
            str(exc)
            if isinstance(exc, GpupoolError)
            else f"cannot start {self.lease.spec.argv[0]!r} in {cwd}: {exc.strerror or exc}"
        )
        self.output.note(detail)
        await self.output.flush()
        return RunResult(Ending.EXITED, self._outcome(None, detail, started))

    async def _supervise(self, pgid: int, started: float) -> RunResult:
        assert self._proc is not None
        loop = asyncio.get_running_loop()
        # The RSS sampler starts once the job has run a while: most never do.
        sample = loop.call_later(FIRST_SAMPLE_SECONDS, self._tree.start, pgid)
        timer = loop.call_later(self.lease.spec.timeout, self._timeout) if self.lease.spec.timeout else None
        ended = False  # (not cancelled meanwhile)
        try:
            returncode = await self._proc.wait()
            ended = True
            self.on_exit()
            # read before the slot may take its next job (`_hand_over`)
            self._usage = self.limits.usage() if self.limits is not None else None
        finally:
            if timer is not None:
                timer.cancel()
            sample.cancel()
            await self._tree.stop()
            if self._killer is not None:
                await cancel_and_wait(self._killer)
            contained = self.cgroup is not None or self.identity is not None  # (JobTree.left)
            left = self._tree.left(pgid, self._proc.left if contained else None)
            try:
                if left:
                    await leftovers.gone(left, LEFTOVERS_SECONDS)
            finally:
                if self.guard is not None:
                    self.guard.forget(pgid)
                if ended and not left:
                    self._hand_over()
                await self._finish_output()
        if left:
            log.warning("job %s left %d processes behind; killed them", self.lease.job_id, len(left))
        dirty = await self._tree.dirty_gpus(pgid, self.probe, self.gpus, self._gpu_asks)
        await self._faulted(returncode)
        await self._save_checkpoint(returncode)
        uploaded: dict[str, Any] = {}
        if self._recorded() and self.store is not None:
            # Uploaded before the fenced complete, under this attempt's own prefix (job_data.py);
            # handed over, its output directory was empty, and is the next job's by now.
            output = None if self._handed_over else self.output_dir
            await self.output.flush()  # the notes since the output ended (its checkpoint's) go in the copy
            uploaded = await job_data.upload_artifacts(
                self.store, self.queue, self.lease, output, logged=self.output.written
            )
        outcome = self._outcome(returncode, "", started, uploaded)
        killed_by = -returncode if returncode < 0 else None
        by_policy = self._by_policy and self.ending is Ending.HANDED_BACK
        why = self.stopped_why if by_policy else ""
        return RunResult(self.ending or Ending.EXITED, outcome, dirty, killed_by, by_policy, why=why)

    async def _faulted(self, returncode: int) -> None:
        """A job that failed by itself of its GPU's fault is handed back as every hand-back is (a
        shell ends STOPPED), or (let_finish) its end names the fault (gpu_fault_end.py)."""
        oom = self._usage is not None and self._usage.oom_kills > 0
        if self.ending is not None or not (fault := await gpu_fault_end(self._gpu_fault, returncode, oom)):
            return
        why = fault.why(describe_exit(returncode)[1])
        if fault.hand_back:  # its process has ended: no stop to ask, the ending is set as one's
            self.ending, self.stopped_why = self._handing_back(why, by_policy=True)
            why = self.stopped_why
        else:
            self._fault = fault.what
        self.output.note(why)
        await self.output.flush()

    async def _finish_output(self) -> None:
        """The rest of the job's output sent, and its terminal, if it had one, closed."""
        try:
            await self.output.finish()
        finally:
            if self.terminal is not None:
                self.terminal.close()

    def _followed(self, returncode: int) -> bool:
        """Whether another attempt may follow this one, to want its checkpoint: handed back, or
        failed with retries (a lost one's job is another attempt's; a success or a cancel ends it)."""
        ending = self.ending or Ending.EXITED
        if ending is Ending.HANDED_BACK:
            return True
        failed = ending is Ending.TIMED_OUT or (ending is Ending.EXITED and returncode != 0)
        return failed and self.lease.spec.retries > 0

    async def _save_checkpoint(self, returncode: int) -> None:
        """The attempt's last save, when another attempt may want it."""
        if self._saving is not None:
            await cancel_and_wait(self._saving)
        if self._saver is None or self._handed_over or not self._followed(returncode):
            return  # (handed over: its checkpoint directory was empty)
        await attempt_checkpoints.save_last(self._saver, self.lease, self.output.note)

    def _recorded(self) -> bool:
        """Whether the attempt's end is an outcome to record (not a hand-back, nor lost)."""
        return (self.ending or Ending.EXITED) not in (Ending.HANDED_BACK, Ending.LOST)

    def _outcome(
        self, returncode: int | None, detail: str, started: float, extra: Mapping[str, Any] | None = None
    ) -> Outcome | None:
        """The outcome to record, `extra` in its result (the artifacts); None when there is none."""
        if not self._recorded():
            return None
        ending = self.ending or Ending.EXITED
        code, how = describe_exit(returncode) if returncode is not None else (None, detail)
        result = attempt_outcome.result(
            peak_rss=self._tree.peak_rss,
            started=started,
            gpus=self.gpus,
            tail=self.output.tail(attempt_outcome.TAIL_LINES),
            returncode=returncode,
            usage=self._usage,
            extra=extra,
        )
        if ending is Ending.CANCELLED:
            return Outcome(JobState.CANCELLED, code, f"cancelled; {how}", result)
        if ending is Ending.IDLE:
            return Outcome(JobState.FAILED, code, f"ended: no input for {self.idle_limit:g} s; {how}", result)
        if ending is Ending.STOPPED:
            return Outcome(JobState.FAILED, code, f"{self.stopped_why}; {how}", result)
        if ending is Ending.TIMED_OUT:
            return Outcome(
                JobState.FAILED, code, f"timed out after {self.lease.spec.timeout:g} s; {how}", result
            )
        return attempt_outcome.exited(
            code, how, returncode, result, usage=self._usage, mem=self.lease.spec.mem, fault=self._fault
        )

    def _hand_over(self) -> None:
        """Every process of the job is gone: when it holds no GPUs (those are looked at first),
        saves no checkpoints while it runs, and changed none of its directories (scratch.py), the
        slot is free for its next job now, before this one's output, outcome and tidying, which
        then never look at the directories again: they were empty, and are the next job's."""
        if (
            self.on_slot_free is None
            or self.gpus
            or self._saving is not None
            or not self.slot.hand_over(self.setup.dirs)
        ):
            return
        self._handed_over = True
        self.on_slot_free()
