"""What NVML says of a GPU's health: the faults that take a GPU out of use, and the Xid events.

A fault is one of a small fixed set (`FAULTS`, also the metrics' `reason` label values):

- `xid`: an Xid critical error the driver reported (an event, `XidWatch`), other than the ones
  NVIDIA counts as the application's (`APPLICATION_XIDS`: the GPU is still sound);
- `ecc`: uncorrectable ECC errors since the driver loaded (the volatile count is above 0; it
  clears with a GPU reset or a reboot);
- `pages`: memory pages waiting to be retired, or rows waiting to be remapped (or a remapping
  that failed): the GPU needs a reset before its memory can be trusted again;
- `lost`: NVML says the GPU has fallen off the bus (NVML_ERROR_GPU_IS_LOST on any call);
- `hung`: NVML does not answer for the GPU at all within a bound (its driver stopped answering, as
  with a GPU falling off the bus): health_watch.py gives it, as its read is what hangs;
- `thermal`: the hardware slows the clocks because the GPU is too hot (HW thermal slowdown);
- `power`: the hardware slows the clocks on its power brake (an external power supply signal).

The throttling the driver does by itself under load (its software power cap, its software
thermal slowdown) is how a GPU keeps to its limits, not a fault, and is not read as one.

`faults_of` reads the conditions of a GPU (`read_faults`, of several in one go), `probe` checks
that a GPU answers and its memory is readable, and `XidWatch` waits for Xid events in a thread of
its own. They all block, and may hang on a failing GPU: the worker calls them from daemon threads,
one per GPU, within a bound (health_watch.py).
A query a GPU does not support (ECC off, retired pages on a GPU that remaps rows instead) says
nothing. MIG devices share their GPU's health: it is read from the GPU itself (`GpuInfo.parent`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pynvml

from daemon.metrics.worker import HEALTH_REASONS
from daemon.worker.gpus import GpuInfo

log = logging.getLogger(__name__)

FAULTS = HEALTH_REASONS  # the metrics' labels name them, so metrics/ holds the list

# Xids the application causes (an illegal address, a bad kernel, a process killed mid-work): the
# same set NVIDIA's Kubernetes device plugin skips, as the GPU stays sound after them.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
# What the common hardware Xids mean, for the sentence the worker and the job's log show.
XID_MEANINGS = {
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP timed out",
    120: "GSP error",
}

HW_THERMAL_SLOWDOWN = 0x40  # nvmlClocksEventReasonHwThermalSlowdown
HW_POWER_BRAKE_SLOWDOWN = 0x80  # nvmlClocksEventReasonHwPowerBrakeSlowdown
XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError
XID_WAIT_MS = 500  # one wait for an Xid: the watch sees its stop within this
XID_PAUSE_MAX = 60.0  # the longest pause between failing waits (it doubles from XID_WAIT_MS)


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault seen on a GPU: its `code` (one of FAULTS) and a sentence saying what it is."""

    code: str
    detail: str


def physical(gpus: Iterable[GpuInfo]) -> dict[str, list[GpuInfo]]:
    """The pool's GPUs by the physical GPU whose health they share (a MIG device's parent)."""
    out: dict[str, list[GpuInfo]] = {}
    for g in gpus:
        out.setdefault(g.parent or g.uuid, []).append(g)
    return out


def xid_fault(xid: int) -> Fault | None:
    """The fault an Xid event means, or None for an application's Xid."""
    if xid in APPLICATION_XIDS:
        return None
    meaning = XID_MEANINGS.get(xid)
    return Fault("xid", f"Xid {xid}" + (f" ({meaning})" if meaning else ""))


def read_faults(uuids: Iterable[str]) -> dict[str, list[Fault]]:
    """The faults each physical GPU of `uuids` shows now (an empty list: none). NVML must be
    initialised. Blocking: call it from a daemon thread."""
    return {uuid: faults_of(uuid) for uuid in uuids}


def faults_of(uuid: str) -> list[Fault]:
    """The faults the physical GPU `uuid` shows now (an empty list: none). Blocking, as
    `read_faults`."""
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        found = [f for read in (_ecc, _pages, _clocks) if (f := read(handle)) is not None]
    except pynvml.NVMLError_GpuIsLost:
        return [Fault("lost", "NVML says the GPU has fallen off the bus")]
    except pynvml.NVMLError as exc:  # not found, or NVML itself failing: no verdict this time
        log.warning("cannot read the health of GPU %s: %s", uuid, exc)
        return []
    return found


def _answer(call: Callable[[], object]) -> object | None:
    """`call`'s answer, or None where the GPU does not support it (or says nothing now); a lost
    GPU's error goes up."""
    try:
        return call()
    except pynvml.NVMLError_GpuIsLost:
        raise
    except pynvml.NVMLError:
        return None


def _ecc(handle: object) -> Fault | None:
    count = _answer(
        lambda: pynvml.nvmlDeviceGetTotalEccErrors(
            handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
        )
    )
    if isinstance(count, int) and count > 0:
        return Fault("ecc", f"{count} uncorrectable ECC error(s) since the driver loaded")
    return None


def _pages(handle: object) -> Fault | None:
    if _answer(lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)) == pynvml.NVML_FEATURE_ENABLED:
        return Fault("pages", "memory pages are waiting to be retired (a GPU reset retires them)")
    rows = _answer(lambda: pynvml.nvmlDeviceGetRemappedRows(handle))
    if isinstance(rows, tuple) and len(rows) == 4:
        _corrected, _uncorrected, pending, failed = rows
        if failed:
            return Fault("pages", "a row remapping failed: the GPU's memory cannot be repaired")
        if pending:
            return Fault("pages", "memory rows are waiting to be remapped (a GPU reset remaps them)")
    return None


def _clocks(handle: object) -> Fault | None:
    reasons = _answer(lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
    if reasons is None:  # a driver before the name: the same bits under the old one
        reasons = _answer(lambda: pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))
    if not isinstance(reasons, int):
        return None
    if reasons & HW_THERMAL_SLOWDOWN:
        return Fault("thermal", "the hardware slows its clocks: the GPU is too hot (HW thermal slowdown)")
    if reasons & HW_POWER_BRAKE_SLOWDOWN:
        return Fault("power", "the hardware slows its clocks on its power brake (HW power brake slowdown)")
    return None


def probe(uuid: str) -> str | None:
    """Why the physical GPU `uuid` is not fit to take jobs, or None: NVML answers for it and its
    memory is readable. Blocking: call it from a daemon thread."""
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    except pynvml.NVMLError as exc:
        return f"NVML does not answer for it ({exc})"
    if not int(memory.total):
        return "NVML reads no memory on it"
    return None


class XidWatch:
    """Waits for Xid critical errors on the physical GPUs `uuids` in a daemon thread of its own,
    calling `seen(uuid, xid)` from that thread for each. Each wait is bounded (XID_WAIT_MS), so
    `stop()` ends it within one; NVML must stay initialised until then (`join`). A driver that
    cannot watch (events not supported) says so once and leaves the other checks to do the work."""

    def __init__(self, uuids: Iterable[str], seen: Callable[[str, int], None]) -> None:
        self._uuids = list(uuids)
        self._seen = seen
        self._stop = threading.Event()
        self._failed: set[str] = set()  # the kinds of wait error logged: each is logged once
        self._pause = XID_WAIT_MS / 1000  # before the next wait after a failed one; grows
        self._thread = threading.Thread(target=self._run, name="gpupool-xid-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the thread's end; whether it ended."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            events = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.warning("cannot watch the GPUs for Xid errors (%s); their other health checks go on", exc)
            return
        try:
            watched = [u for u in self._uuids if self._register(u, events)]
            while watched and not self._stop.is_set():
                self._wait_once(events)
        finally:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlEventSetFree(events)

    def _register(self, uuid: str, events: object) -> bool:
        try:
            pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByUUID(uuid), XID_EVENT, events)
        except pynvml.NVMLError as exc:
            log.warning("cannot watch GPU %s for Xid errors (%s); its other health checks go on", uuid, exc)
            return False
        return True

    def _wait_once(self, events: object) -> None:
        try:
            data = pynvml.nvmlEventSetWait_v2(events, XID_WAIT_MS)
        except pynvml.NVMLError_Timeout:
            self._pause = XID_WAIT_MS / 1000
            return
        except pynvml.NVMLError as exc:  # GPU lost mid-wait, or NVML failing: the reads see which
            if (kind := type(exc).__name__) not in self._failed:
                self._failed.add(kind)
                log.warning(
                    "waiting for Xid errors failed (%s); tried again less often, not logged again", exc
                )
            self._stop.wait(self._pause)  # not a poll: a pause, growing, before the next wait
            self._pause = min(XID_PAUSE_MAX, self._pause * 2)
            return
        self._pause = XID_WAIT_MS / 1000
        if not int(data.eventType) & XID_EVENT:
            return
        try:
            uuid = pynvml.nvmlDeviceGetUUID(data.device)
        except pynvml.NVMLError as exc:
            log.error("Xid %d on a GPU NVML cannot name (%s)", int(data.eventData), exc)
            return
        self._seen(uuid.decode() if isinstance(uuid, bytes) else str(uuid), int(data.eventData))
