"""Object transfer rates: gpupool's S3 store against plain single-stream aiobotocore, same endpoint.

Starts a SeaweedFS S3 endpoint (`weed mini`, as the tests do), writes one file of random bytes, and
for each run measures, on the same endpoint and in the same process:

- gpupool upload: `S3Store.put_file` (sha256 pass, multipart, `concurrency` parts in flight)
- gpupool download: `S3Store.get_file` (ranged parallel GET, verified sha256, atomic rename)
- baseline upload: one `put_object` of the whole file
- baseline download: one `get_object`, body streamed to a file

Reported as MiB/s, median of the runs, with the gpupool/baseline ratio. On a small machine the
S3 server shares the CPUs with the client, so the ratio says more than the absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop
from aiobotocore.session import get_session
from botocore.config import Config
from rich.console import Console
from rich.table import Table

from bench.common import machine, median, save
from storage.s3 import MiB, S3Store
from tests.support.s3server import S3Server

BUCKET = "bench"


def write_random(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        for start in range(0, size, 4 * MiB):
            f.write(os.urandom(min(4 * MiB, size - start)))


async def baseline_get(client: Any, key: str, dest: Path) -> None:
    r = await client.get_object(Bucket=BUCKET, Key=key)
    with open(dest, "wb") as f:  # noqa: ASYNC230 - the baseline is the naive way, on purpose
        async with r["Body"] as body:
            async for chunk in body.iter_chunks(MiB):
                f.write(chunk)


def same_bytes(*paths: Path) -> bool:
    first = paths[0].read_bytes()
    return all(p.read_bytes() == first for p in paths[1:])


async def one_run(store: S3Store, client: Any, src: Path, work: Path, run: int) -> dict[str, float]:
    size_mib = (await asyncio.to_thread(src.stat)).st_size / MiB
    out: dict[str, float] = {}

    async def timed(name: str, op: Any) -> None:
        t0 = time.perf_counter()
        await op
        out[name] = size_mib / (time.perf_counter() - t0)

    await timed("gpupool_upload", store.put_file(f"g{run}", src))
    await timed("gpupool_download", store.get_file(f"g{run}", work / "g.back"))
    data = await asyncio.to_thread(src.read_bytes)
    await timed("baseline_upload", client.put_object(Bucket=BUCKET, Key=f"b{run}", Body=data))
    del data
    await timed("baseline_download", baseline_get(client, f"b{run}", work / "b.back"))
    assert await asyncio.to_thread(same_bytes, src, work / "g.back", work / "b.back")
    for key in (f"g{run}", f"b{run}"):
        await store.delete(key)
    return out


async def measure(
    server: S3Server, src: Path, work: Path, *, runs: int, part: int, conc: int
) -> dict[str, Any]:
    store = S3Store(
        server.endpoint, BUCKET, server.access_key, server.secret_key, part_size=part, concurrency=conc
    )
    config = Config(
        s3={"addressing_style": "path"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    async with (
        store,
        get_session().create_client(
            "s3",
            endpoint_url=server.endpoint,
            region_name="us-east-1",
            aws_access_key_id=server.access_key,
            aws_secret_access_key=server.secret_key,
            config=config,
        ) as client,
    ):
        await store.ensure_bucket()
        await store.put_bytes("warm", b"x")  # connection set-up is not part of any sample
        samples = [await one_run(store, client, src, work, run) for run in range(runs)]
    medians = {k: median([s[k] for s in samples]) for k in samples[0]}
    return {
        "samples": samples,
        "median_mib_s": medians,
        "ratio": {
            "upload": medians["gpupool_upload"] / medians["baseline_upload"],
            "download": medians["gpupool_download"] / medians["baseline_download"],
        },
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--part-mib", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "s3").mkdir()
        server = S3Server(work / "s3")
        server.start()
        try:
            src = work / "src"
            write_random(src, args.size_mib * MiB)
            result = uvloop.run(
                measure(server, src, work, runs=args.runs, part=args.part_mib * MiB, conc=args.concurrency)
            )
        finally:
            server.stop()
    result = {
        "machine": machine(),
        "endpoint": "seaweedfs weed mini (loopback)",
        "size_mib": args.size_mib,
        "runs": args.runs,
        "part_mib": args.part_mib,
        "concurrency": args.concurrency,
        **result,
    }
    med, ratio = result["median_mib_s"], result["ratio"]
    table = Table(
        title=f"object transfer, {args.size_mib} MiB file, SeaweedFS on loopback ({args.runs} runs, median)"
    )
    for col in ("direction", "gpupool MiB/s", "baseline MiB/s", "ratio"):
        table.add_column(col, justify="right" if col != "direction" else "left")
    for d in ("upload", "download"):
        table.add_row(d, f"{med[f'gpupool_{d}']:,.1f}", f"{med[f'baseline_{d}']:,.1f}", f"{ratio[d]:.2f}x")
    Console().print(table)
    print(
        f"gpupool: {args.concurrency} parts of {args.part_mib} MiB in flight, sha256 verified end to end; "
        "baseline: one put_object / get_object stream, no checksum of its own"
    )
    print(f"wrote {save('transfer', result)}")


if __name__ == "__main__":
    main()
