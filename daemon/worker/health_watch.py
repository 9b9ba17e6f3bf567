"""GPU health: a faulty GPU is quarantined, its job told and handed back (or let finish), and the
GPU comes back only after a check passes.

The worker reads its GPUs' health (gpu_health.py) once per heartbeat interval, beside their
readings, each physical GPU asked in a daemon thread of its own (nvml_asks.py), and an Xid watch
waits for Xid events in another. NVML calls block and may hang on a failing GPU (its driver
stopped answering, as with a GPU falling off the bus): a pass waits NVML_READ_SECONDS at most for
the GPUs' reads. A read still unanswered is not asked again until it answers, and gives no verdict
until it has gone unanswered for HUNG_SECONDS: then the GPU is faulty (`hung`, "NVML does not
answer"), each pass while that read hangs; a read that answers sooner (a driver lock held a few
seconds) is no fault. The other GPUs go on being read; the event loop, and so the worker's stop,
never waits for a hung read.
What they find reaches the event loop, where this module keeps the book (`HealthBook`) and acts:

- A fault (gpu_health.FAULTS) takes the GPU out of use at once: the allocator hands it to no new
  job (`GpuAllocator.mark_unhealthy`), the worker's claims stop counting it (its GPUs in all
  shrink, so a job needing it waits for another worker), and its registration says why (the GPU's
  `health` code and its `quarantined` sentence, which `poolctl workers` and the dashboard show).
- The job running on it is told in its log (a [gpupool] line) and, with `gpu_health_policy`
  "requeue" (the default), stopped and handed back to the front of its queue, as a drain hands a
  job back, to run on a sound GPU; with "let_finish" it runs on to its end.
- A failing GPU most often kills its job first (a CUDA error, exit 1), before a pass sees the
  fault. So a job that fails by itself is checked at its end (`fault_under`): a fault that kills
  programs (gpu_fault_end.py) seen on one of its GPUs while it ran, or read on them then, hands
  it back as the stop above would have ("requeue"), or names the fault in its outcome's detail
  ("let_finish"), not a failure of its own.
- The GPU comes back when no fault has been seen on it for `gpu_health_clear` seconds (no new Xid,
  ECC and pages fine, no hardware slowdown, NVML answering) and a probe then passes (NVML answers
  for it and its memory is readable). A restart of the worker forgets the Xids seen before it;
  the other faults, which NVML keeps until a GPU reset, are seen again at its first read.

The book is kept per physical GPU: a MIG device shares its GPU's health.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from daemon.worker import gpu_health
from daemon.worker.gpu_fault_end import KILLING, GpuFaulted
from daemon.worker.gpu_health import Fault
from daemon.worker.gpus import GpuAllocator, GpuInfo
from daemon.worker.nvml_asks import HUNG_SECONDS, GpuAsks
from daemon.worker.run_types import Run

log = logging.getLogger(__name__)

POLICIES = ("requeue", "let_finish")
XID_JOIN_SECONDS = 2.0  # the longest the worker's stop waits for the Xid watch (one wait is 0.5 s)

# How long each kind of fault lasts, longest first: a GPU out of use shows the most lasting of
# the faults seen on it, since a slowdown clears when the GPU cools but an ECC error stays.
LASTING = ("lost", "ecc", "pages", "hung", "xid", "thermal", "power")


HUNG = Fault("hung", f"NVML does not answer (no health read in {HUNG_SECONDS:g} s)")


@dataclass(frozen=True, slots=True)
class Reading:
    """One physical GPU's health read: the faults it shows now, and, when it was due to come
    back, its probe's verdict (`probed`; `why` None: passed)."""

    faults: list[Fault]
    probed: bool = False
    why: str | None = None


@dataclass(slots=True)
class Unhealthy:
    """A physical GPU out of use: the faults seen on it (the latest of each kind), when it went
    out (time.time()), and when a fault was last seen on it (time.monotonic())."""

    faults: dict[str, Fault]
    since: float
    last_seen: float

    @property
    def fault(self) -> Fault:
        """The most lasting fault seen: the reason it shows."""
        return min(
            self.faults.values(), key=lambda f: LASTING.index(f.code) if f.code in LASTING else len(LASTING)
        )


class HealthBook:
    """Which physical GPUs are out of use and when each may come back: pure bookkeeping, fed the
    faults seen and the probes' verdicts, so that tests drive it with made-up ones."""

    def __init__(self, clear: float) -> None:
        self.clear = clear  # seconds without a fault before a GPU is probed to come back
        self.unhealthy: dict[str, Unhealthy] = {}

    def seen(self, uuid: str, fault: Fault, now: float) -> bool:
        """A fault seen on `uuid` at `now` (monotonic); True when it takes the GPU out of use.
        A GPU already out keeps every kind seen (`new_kind` says whether this one was new)."""
        if (bad := self.unhealthy.get(uuid)) is not None:
            bad.last_seen = max(bad.last_seen, now)
            bad.faults[fault.code] = fault
            return False
        self.unhealthy[uuid] = Unhealthy({fault.code: fault}, time.time(), now)
        return True

    def new_kind(self, uuid: str, fault: Fault) -> bool:
        """Whether `fault` is of a kind not yet seen on `uuid` since it went out of use (asked
        before `seen`, so that each kind is logged once)."""
        bad = self.unhealthy.get(uuid)
        return bad is not None and fault.code not in bad.faults

    def due(self, now: float) -> list[str]:
        """The GPUs out of use with no fault seen for `clear` seconds: those a probe may put back."""
        return [uuid for uuid, bad in self.unhealthy.items() if now - bad.last_seen >= self.clear]

    def passed(self, uuid: str, now: float) -> bool:
        """`uuid`'s probe passed at `now`: True when that puts it back (it was due, and no fault
        came meanwhile)."""
        if uuid not in self.due(now):
            return False
        del self.unhealthy[uuid]
        return True

    def fault(self, uuid: str) -> Fault | None:
        bad = self.unhealthy.get(uuid)
        return bad.fault if bad is not None else None


class HealthWatch:
    """The worker's GPU health: `run()` reads every `every` seconds until cancelled and acts on
    `allocator` and the running jobs (`runs()`), calling `back()` when a GPU comes back (the
    dispatcher may claim for it). NVML must be initialised for as long as `run()` runs."""

    def __init__(
        self,
        gpus: Sequence[GpuInfo],
        allocator: GpuAllocator,
        runs: Callable[[], Iterable[Run]],
        back: Callable[[], None],
        *,
        every: float,
        clear: float,
        policy: str = "requeue",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"gpu_health_policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        self._devices = gpu_health.physical(gpus)
        self._allocator = allocator
        self._runs = runs
        self._on_back = back
        self._every = every
        self._policy = policy
        self.book = HealthBook(clear)
        # Each physical GPU's read, one at a time: a GPU that hangs holds one thread, not one per pass.
        self._reads: GpuAsks[Reading] = GpuAsks("gpupool-gpu-health")

    def for_gpu(self, uuid: str, parent: str | None = None) -> dict[str, Any]:
        """The health of GPU `uuid` (a MIG device of `parent`) as registration fields: its fault's
        code ("" for none) and since when (Unix time)."""
        bad = self.book.unhealthy.get(parent or uuid)
        return {"health": bad.fault.code, "health_since": bad.since} if bad else {"health": ""}

    def reasons(self) -> Mapping[str, str]:
        """Each GPU's fault code ("" for none), by UUID, for the metrics."""
        return {
            g.uuid: (f.code if (f := self.book.fault(physical)) else "")
            for physical, devices in self._devices.items()
            for g in devices
        }

    async def run(self) -> None:
        loop = asyncio.get_running_loop()

        def seen(uuid: str, xid: int) -> None:  # in the Xid watch's thread
            loop.call_soon_threadsafe(self._xid, uuid, xid)

        xids = gpu_health.XidWatch(self._devices, seen)
        xids.start()
        try:
            while True:
                faults, probes = await self._pass()
                self._apply(faults, probes, time.monotonic())
                await asyncio.sleep(self._every)
        finally:
            xids.stop()  # and NVML stays initialised until its last wait is over
            if not await asyncio.to_thread(xids.join, XID_JOIN_SECONDS):
                log.warning("the Xid watch did not end in %g s; NVML is closed under it", XID_JOIN_SECONDS)

    async def _pass(self) -> tuple[dict[str, list[Fault]], dict[str, str | None]]:
        """One pass: each physical GPU's faults, and the probe's verdict on those due to come
        back, each GPU read in a daemon thread of its own (nvml_asks.py). A read unanswered for
        HUNG_SECONDS is the GPU's fault (`hung`), this pass and each next one while it hangs;
        one unanswered for less says nothing yet."""
        due = set(self.book.due(time.monotonic()))
        reads = await self._reads.ask({u: functools.partial(self._read, u, u in due) for u in self._devices})
        now = time.monotonic()
        faults: dict[str, list[Fault]] = {}
        probes: dict[str, str | None] = {}
        for uuid, read in reads.items():
            if not read.answer.done():
                if read.hung(now):
                    faults[uuid] = [HUNG]
                continue
            try:
                got = read.answer.result()
            except Exception as exc:  # noqa: BLE001 - a driver's error: no verdict this pass
                log.warning("cannot read the health of GPU %s: %s", uuid, exc)
                continue
            faults[uuid] = got.faults
            if got.probed:
                probes[uuid] = got.why
        return faults, probes

    @staticmethod
    def _read(uuid: str, due: bool) -> Reading:
        """One GPU's read, in its health thread: its faults, and its probe when `due`."""
        faults = gpu_health.faults_of(uuid)
        return Reading(faults, True, gpu_health.probe(uuid)) if due else Reading(faults)

    async def fault_under(self, gpus: Sequence[GpuInfo]) -> GpuFaulted | None:
        """The fault that kills programs (gpu_fault_end.KILLING) on one of `gpus`, those of a job
        that failed by itself, and what `gpu_health_policy` makes of it; None when they show none.
        A GPU out of use had its fault while the job held it (a GPU out takes no new job), and
        the book says which (its NVML may hang: it is not read); the others are read now, as a
        pass reads them (nvml_asks.py: a fault read here quarantines the GPU at once),
        NVML_READ_SECONDS at most: one of them may have failed beside one out for a slowdown. A
        read that fails or hangs (a lost GPU's NVML) gives no verdict, but the book does: the Xid
        watch or a pass may have taken the GPU out meanwhile."""
        held = {g.parent or g.uuid for g in gpus} & self._devices.keys()
        if unread := {uuid for uuid in held if uuid not in self.book.unhealthy}:
            # (a read a pass asked a moment before is waited for too: the dying job's context
            # torn down may hold the driver a few seconds, and its answer is this check's)
            calls = {u: functools.partial(self._read, u, False) for u in unread}
            reads = await self._reads.ask(calls, wait_pending=True)
            found: dict[str, list[Fault]] = {}
            for uuid, read in reads.items():
                if not read.answer.done():
                    continue  # (a pass says `hung` once it has hung long enough)
                if (exc := read.answer.exception()) is not None:  # a driver's error: the book says
                    log.warning("cannot read the health of GPU %s at its job's end: %r", uuid, exc)
                    continue
                found[uuid] = read.answer.result().faults
            self._apply(found, {}, time.monotonic())
        for uuid in sorted(held):  # (a GPU's shown fault is its most lasting: a killing one if any)
            if (fault := self.book.fault(uuid)) is not None and fault.code in KILLING:
                what = f"GPU {self._devices[uuid][0].index} ({uuid}) is unhealthy: {fault.detail}"
                return GpuFaulted(what, hand_back=self._policy == "requeue")
        return None

    def _xid(self, uuid: str, xid: int) -> None:
        fault = gpu_health.xid_fault(xid)
        if fault is None:
            log.info("GPU %s: Xid %d, an application's error: the GPU stays in use", uuid, xid)
        elif uuid in self._devices:
            self._seen(uuid, fault, time.monotonic())

    def _apply(self, faults: Mapping[str, list[Fault]], probes: Mapping[str, str | None], now: float) -> None:
        for uuid, found in faults.items():
            for fault in found:
                self._seen(uuid, fault, now)
        for uuid, why in probes.items():
            if why is not None:
                log.warning("GPU %s stays quarantined: its check failed: %s", uuid, why)
            elif not faults.get(uuid) and self.book.passed(uuid, now):
                self._back(uuid)

    def _seen(self, uuid: str, fault: Fault, now: float) -> None:
        new_kind = self.book.new_kind(uuid, fault)
        if not self.book.seen(uuid, fault, now):
            if new_kind:
                shown = self.book.unhealthy[uuid].fault
                log.error("GPU %s, out of use, shows a new fault: %s", uuid, fault.detail)
                for g in self._devices[uuid]:
                    self._allocator.mark_unhealthy(g.uuid, shown.detail)
            return
        devices = self._devices[uuid]
        what = f"GPU {devices[0].index} ({uuid}) is unhealthy: {fault.detail}"
        log.error("%s; quarantined: it takes no new job until it passes its check", what)
        for g in devices:
            self._allocator.mark_unhealthy(g.uuid, fault.detail)
        held = {g.uuid for g in devices}
        for run in self._runs():
            if run.exited or not held.intersection(g.uuid for g in run.gpus):
                continue  # (an ended job's end check says what the fault made of its end)
            if self._policy == "requeue":
                run.hand_back(
                    why=f"{what}; the job goes back to its queue to run on a sound GPU", by_policy=True
                )
            else:
                run.note(f"{what}; the job runs on to its end (gpu_health_policy let_finish)")

    def _back(self, uuid: str) -> None:
        for g in self._devices[uuid]:
            self._allocator.mark_healthy(g.uuid)
        log.info("GPU %s passed its check after %g s without a fault: back in use", uuid, self.book.clear)
        self._on_back()
