"""Wire-protocol cost: round trip of a no-op request (PING op) over loopback, one at a time
(p50/p99), and requests/s on one connection with many requests in flight (pipelined).

Runs a real pool server (embedded Redis, in this process) and a real client over TCP.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import uvloop
from rich.console import Console
from rich.table import Table

from bench.common import machine, save
from daemon import config, tokens
from daemon.client.pool_client import PoolClient
from daemon.server.service import PoolServer
from protocol import Ping, Pong


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def measure(requests: int, in_flight: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["XDG_CONFIG_HOME"] = str(Path(tmp) / "xdg")  # the bench's own token and address
        cfg = config.load(
            None,
            env={
                "GPUPOOL_DATA_DIR": tmp,
                "GPUPOOL_LISTEN": "127.0.0.1:0",
                "GPUPOOL_METRICS_LISTEN": "127.0.0.1:0",
            },
        )
        server = PoolServer(cfg)
        await server.start()
        try:
            assert server.listener is not None
            client = PoolClient(server.listener.address, tokens.local_user(), tokens.client_token())
            async with client:
                for _ in range(200):  # warm up
                    await client.call(Ping(), Pong)
                rtts = []
                for _ in range(requests):
                    t0 = time.perf_counter()
                    await client.call(Ping(), Pong)
                    rtts.append((time.perf_counter() - t0) * 1e6)
                sem = asyncio.Semaphore(in_flight)

                async def one() -> None:
                    async with sem:
                        await client.call(Ping(), Pong)

                t0 = time.perf_counter()
                await asyncio.gather(*(one() for _ in range(requests)))
                pipelined = requests / (time.perf_counter() - t0)
        finally:
            await server.stop()
    return {
        "machine": machine(),
        "requests": requests,
        "in_flight": in_flight,
        "rtt_us": {"p50": percentile(rtts, 50), "p99": percentile(rtts, 99), "mean": statistics.fmean(rtts)},
        "sequential_per_s": 1e6 / statistics.fmean(rtts),
        "pipelined_per_s": pipelined,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--in-flight", type=int, default=64)
    args = p.parse_args(argv)
    result = uvloop.run(measure(args.requests, args.in_flight))
    rtt = result["rtt_us"]
    assert isinstance(rtt, dict)
    table = Table(title="wire protocol over loopback (no-op request)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("round trip p50", f"{rtt['p50']:.0f} µs")
    table.add_row("round trip p99", f"{rtt['p99']:.0f} µs")
    table.add_row("sequential requests/s", f"{result['sequential_per_s']:,.0f}")
    table.add_row(f"pipelined requests/s ({args.in_flight} in flight)", f"{result['pipelined_per_s']:,.0f}")
    Console().print(table)
    print(f"wrote {save('protocol_rtt', result)}")


if __name__ == "__main__":
    main()
