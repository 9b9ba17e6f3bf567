"""What a job leaves behind, and the sweep that ends it: its process tree, the processes that
escaped its group or session, and GPU memory its processes still hold.

The run's JobTree (job_tree.py) samples `tree` while the job runs (RSS, and every descendant's
pid with its creation time, so that a pid reused later is not taken for the job's); when the
job's first process exits,
`leftovers` SIGKILLs whatever of it is left, and `check_gpus` names the GPUs a process of the job
still holds memory on (they are quarantined until it is freed).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import time
from collections.abc import Mapping, Sequence

import psutil

from daemon.worker.gpus import GpuInfo, GpuProbe, GpuProbeError
from daemon.worker.nvml_asks import GpuAsks

GPU_SETTLE_SECONDS = 3.0  # how long a GPU may take to free a dead process's memory


def tree(pgid: int) -> tuple[int, dict[int, float]]:
    """RSS of the job's first process and its descendants, and their pids with creation times."""
    try:
        root = psutil.Process(pgid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0, {}
    rss, seen = 0, {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            rss += p.memory_info().rss
            seen[p.pid] = p.create_time()
    return rss, seen


def leftovers(pgid: int, descendants: Mapping[int, float]) -> list[psutil.Process]:
    """SIGKILL what is left of a job that has neither a cgroup nor a uid of its own: its group,
    any process of its session (one that changed its group), any descendant seen while it ran
    that moved to a session of its own. Returns the processes that were left. One getsid() per
    process on the machine: the other /proc reads are made only for the job's own."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    left = []
    for pid in psutil.pids():
        try:
            ours = os.getsid(pid) == pgid
        except OSError:
            continue
        if not ours and pid not in descendants:
            continue
        try:
            p = psutil.Process(pid)
            if not ours and p.create_time() != descendants[pid]:
                continue  # the pid was reused by a process that is not the job's
            if p.status() == psutil.STATUS_ZOMBIE:
                continue  # already dead, waiting for its parent (or init) to reap it
            p.kill()
        except psutil.Error:
            continue
        left.append(p)
    return left


def processes(pids: Sequence[int]) -> list[psutil.Process]:
    """Those of `pids` still there (killed in the job's cgroup by the spawner; to wait for)."""
    left = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            left.append(psutil.Process(pid))
    return left


async def gone(procs: Sequence[psutil.Process], seconds: float) -> None:
    """Wait until every one of `procs` (killed) has exited, `seconds` at most: each watched by a
    pidfd, which is readable once its process has exited. A zombie has: it runs no code and holds
    nothing, and whether it is reaped is its parent's business (an orphan's parent is init, which
    may be slow to do it, or in a container never)."""
    loop = asyncio.get_running_loop()
    exits: dict[int, asyncio.Future[None]] = {}
    try:
        for proc in procs:
            try:
                fd = os.pidfd_open(proc.pid)
            except ProcessLookupError:
                continue
            except OSError:  # no pidfds (before Linux 5.3): psutil polls
                await asyncio.to_thread(psutil.wait_procs, procs, timeout=seconds)
                return
            exits[fd] = loop.create_future()
            loop.add_reader(fd, exited, exits[fd])
            if not proc.is_running():  # the pid was reused meanwhile by someone else's process
                exits[fd].set_result(None)
        if exits:
            await asyncio.wait(exits.values(), timeout=seconds)
    finally:
        for fd in exits:
            loop.remove_reader(fd)
            os.close(fd)


def exited(exit: asyncio.Future[None]) -> None:
    """A pidfd's reader: its process has exited."""
    if not exit.done():
        exit.set_result(None)


# Why a GPU NVML could not answer for is dirty: it will not answer better for a wait (fallen off the
# bus), unlike memory a dead process holds, which the driver frees a moment later.
UNCHECKED = "cannot check it after the job"


async def check_gpus(
    probe: GpuProbe, gpus: Sequence[GpuInfo], ours: set[int], sid: int, asks: GpuAsks[set[int]]
) -> dict[str, str]:
    """The GPUs of `gpus` on which a process of the job (`ours`, or of its session `sid`) still
    holds memory, after a short settling time, with why. Each GPU is asked through `asks` (the
    worker's, shared by its end and quarantine checks), in a daemon thread of its own, within a
    bound (nvml_asks.py): NVML may hang on a GPU whose driver stopped answering (the health watch
    takes it out), and the attempt's end, its hand-back and the worker's stop must not wait for
    it; a GPU whose ask still hangs is not asked again (one thread per hung GPU, however many
    jobs end on it). An ask another check made a moment before is waited for, within the bound
    too (a job ending beside another on the same GPU), but its answer, older than the job's
    end, says clean only once asked again. A GPU that does not answer counts as dirty
    (unchecked)."""
    began = time.monotonic()
    deadline = began + GPU_SETTLE_SECONDS
    while True:
        calls = {g.uuid: functools.partial(probe.compute_pids, g.uuid) for g in gpus}
        asked = await asks.ask(calls, wait_pending=True)
        dirty, older = {}, False
        for uuid, ask in asked.items():
            if not ask.answer.done():
                dirty[uuid] = f"{UNCHECKED}: NVML does not answer"
                continue
            if ask.since < began:  # (asked before the job's end: a process it started since is not in it)
                older = True
            try:
                pids = ask.answer.result()
            except GpuProbeError as exc:
                dirty[uuid] = f"{UNCHECKED}: {exc}"
                continue
            held = sorted(pid for pid in pids if pid in ours or session(pid) == sid)
            if held:
                dirty[uuid] = f"processes {held} of the job still hold memory on it"
        settling = [why for why in dirty.values() if not why.startswith(UNCHECKED)]
        if not (settling or older) or time.monotonic() > deadline:
            return dirty
        # The driver frees a dead process's memory a moment after the process is reaped.
        await asyncio.sleep(0.25)


def session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None
