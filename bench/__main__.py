"""`python -m bench` (make bench): run every benchmark in turn, then the ratios against the targets.

`--quick` passes --quick to the benchmarks that take it; `--skip-transfer` leaves out the S3 one.
"""

import sys
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from bench import (
    enqueue,
    env_start,
    failover,
    interactive,
    latency,
    peers,
    policies,
    protocol_rtt,
    python_api,
    queue_rates,
    scale,
    throughput,
)
from bench.common import RESULTS


def load(name: str) -> Any:
    return orjson.loads((RESULTS / f"{name}.json").read_bytes())


def summary() -> Table:
    lat, thr, enq, peer = (
        load("latency"),
        load("throughput")["rates"],
        load("enqueue"),
        load("peers")["peers"],
    )
    ok = {k: v for k, v in peer.items() if "drain_per_s" in v}
    best_drain = max(ok.items(), key=lambda kv: kv[1]["drain_per_s"])
    best_submit = max(peer.items(), key=lambda kv: kv[1].get("submit_per_s", 0))
    best_bulk = max(peer.items(), key=lambda kv: kv[1].get("submit_bulk_per_s", 0))
    noop1 = thr["noop_1_worker_8_slots"]["jobs_per_s"]
    t = Table(title="gpupool against the targets of issue 8 (this run)")
    for col in ("measure", "value", "target"):
        t.add_column(col)
    t.add_row(
        "no-op drain, 1 worker (8 slots) / best peer",
        f"{noop1 / best_drain[1]['drain_per_s']:.2f}x ({best_drain[0]})",
        "≥ 2x",
    )
    t.add_row(
        "no-op drain, 1 worker (8 slots) / raw XADD→XREADGROUP→XACK",
        f"{noop1 / thr['ceiling_streams_unbatched']['jobs_per_s']:.2f}x unbatched, "
        f"{noop1 / thr['ceiling_streams_batch100']['jobs_per_s']:.2f}x batched",
        "≥ 0.5x",
    )
    n = lat["noop"]["enqueue_to_start_ms"]
    t.add_row(
        "enqueue→start, queue alone", f"p50 {n['p50']:.2f} ms, p99 {n['p99']:.2f} ms", "p50 ≤ 2, p99 ≤ 5 ms"
    )
    c = lat["command"]["enqueue_to_process_started_ms"]
    t.add_row(
        "enqueue→process start, `true`", f"p50 {c['p50']:.2f} ms, p99 {c['p99']:.2f} ms", "queue + spawn"
    )
    t.add_row(
        "submit one at a time / best peer",
        f"{enq['one_at_a_time_per_s'] / best_submit[1]['submit_per_s']:.2f}x ({best_submit[0]})",
        "≥ 2x",
    )
    t.add_row(
        "submit batched / best bulk (RQ enqueue_many)",
        f"{enq['batched_per_s'] / best_bulk[1]['submit_bulk_per_s']:.2f}x ({best_bulk[0]})",
        "≥ 2x",
    )
    for slots in (2, 8):
        for kind, what in (("", ""), ("_slot_uids", ", slot uids")):
            if (r := thr.get(f"true_1_worker_{slots}_slots{kind}")) is not None:
                # the median of its rounds' ratios, each to the ceiling measured around it
                t.add_row(
                    f"`true` jobs, {slots} slots{what} / bare spawn loop", f"{r['ratio']:.2f}x", "≥ 0.8x"
                )
                if "to_task_spooler" in r:
                    t.add_row(
                        f"`true` jobs, {slots} slots{what} / task-spooler",
                        f"{r['to_task_spooler']:.2f}x",
                        "≥ 1.0x",
                    )
    return t


def main(argv: list[str]) -> None:
    quick = ["--quick"] if "--quick" in argv else []
    queue_rates.main([])
    protocol_rtt.main([])
    if "--skip-transfer" not in argv:
        from bench import transfer

        transfer.main([])
    latency.main(quick)
    throughput.main(quick)
    enqueue.main(quick)
    peers.main(quick)
    scale.main(["--quick"] if quick else ["--workers", "100,1000", "--jobs", "50000", "--seconds", "10"])
    failover.main(quick)
    policies.main(quick)
    env_start.main(quick)
    python_api.main(quick)
    interactive.main(quick)
    Console().print(summary())


main(sys.argv[1:])
