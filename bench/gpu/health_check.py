"""The GPU health fields NVML gives on a real GPU, read with the worker's own code
(daemon/worker/gpu_health.py): for each physical GPU the raw fields the worker judges (uncorrectable
and correctable volatile ECC counts, retired pages pending, remapped rows, clocks event reasons), the
temperature and power beside them, whether the GPU reports Xid events, the faults the worker would
see in them, the probe's verdict, how long one pass of reads takes, and the Xid events seen while
it watches for `--watch` seconds.

Run on a machine with an NVIDIA GPU: `python -m bench.gpu.health_check [--watch 5] [--json OUT]`
(results: bench/README.md). Without a driver or a GPU it says so and exits 0: the test suite runs it
so (tests/bench/test_smallest.py)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# On a GPU machine without the project's venv, only pynvml needs to travel (in `.devcheck/site`):
# the metrics module the worker's GPU code names is stood in for (bench/gpu/common.py).
sys.path[:0] = [".devcheck/site", "."]
from bench.gpu.common import stand_in_worker_metrics  # noqa: E402

stand_in_worker_metrics()

import pynvml  # noqa: E402

from daemon.worker import gpu_health  # noqa: E402
from daemon.worker.gpus import discover  # noqa: E402

NOTHING = "not supported"


def field(call: Callable[[], Any]) -> Any:
    """A raw NVML answer, or why there is none."""
    try:
        return call()
    except pynvml.NVMLError as exc:
        return NOTHING if isinstance(exc, pynvml.NVMLError_NotSupported) else f"error: {exc}"


def raw_fields(uuid: str) -> dict[str, Any]:
    """What NVML answers for the fields the worker's health check reads (and a few beside)."""
    h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    unc, cor, vol = (
        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
        pynvml.NVML_VOLATILE_ECC,
    )
    reasons = field(lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(h))
    return {
        "name": field(lambda: pynvml.nvmlDeviceGetName(h)),
        "ecc_mode": field(lambda: pynvml.nvmlDeviceGetEccMode(h)),
        "ecc_uncorrected_volatile": field(lambda: pynvml.nvmlDeviceGetTotalEccErrors(h, unc, vol)),
        "ecc_corrected_volatile": field(lambda: pynvml.nvmlDeviceGetTotalEccErrors(h, cor, vol)),
        "retired_pages_pending": field(lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h)),
        "remapped_rows": field(lambda: list(pynvml.nvmlDeviceGetRemappedRows(h))),
        "clocks_event_reasons": hex(reasons) if isinstance(reasons, int) else reasons,
        "temperature_c": field(lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
        "power_w": field(lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000),
        "xid_events_supported": field(
            lambda: bool(pynvml.nvmlDeviceGetSupportedEventTypes(h) & gpu_health.XID_EVENT)
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--watch", type=float, default=5.0, help="seconds to watch for Xid events")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    gpus, nvml = discover()
    if nvml is None or not gpus:
        print("GPU health fields: no NVIDIA driver or GPU here, nothing to read")
        return 0
    physical = list(gpu_health.physical(gpus))
    out: dict[str, Any] = {"gpus": {}}
    try:
        for uuid in physical:
            out["gpus"][uuid] = raw_fields(uuid)
        t0 = time.perf_counter()
        faults = gpu_health.read_faults(physical)
        out["read_faults_ms"] = round((time.perf_counter() - t0) * 1000, 2)
        t0 = time.perf_counter()
        probes = {uuid: gpu_health.probe(uuid) for uuid in physical}
        out["probe_ms"] = round((time.perf_counter() - t0) * 1000, 2)
        seen: list[tuple[str, int]] = []
        lock = threading.Lock()

        def xid(uuid: str, code: int) -> None:
            with lock:
                seen.append((uuid, code))

        watch = gpu_health.XidWatch(physical, xid)
        watch.start()
        time.sleep(args.watch)
        watch.stop()
        out["xid_watch_ended"] = watch.join(2.0)
        out["xids_seen"] = seen
    finally:
        nvml.close()
    print(f"GPU health fields of {len(physical)} GPU(s), read with daemon/worker/gpu_health.py:")
    for uuid, fields in out["gpus"].items():
        print(f"  {uuid}")
        for key, value in fields.items():
            print(f"    {key:26} {value}")
        found = [f"{f.code}: {f.detail}" for f in faults[uuid]]
        print(f"    {'faults the worker sees':26} {found or 'none'}")
        print(f"    {'probe':26} {probes[uuid] or 'passed'}")
        out["gpus"][uuid] |= {"faults": found, "probe": probes[uuid] or "passed"}
    print(
        f"one pass of health reads: {out['read_faults_ms']} ms; probe: {out['probe_ms']} ms; "
        f"Xid events in {args.watch:g} s: {seen or 'none'} (the watch ended: {out['xid_watch_ended']})"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
