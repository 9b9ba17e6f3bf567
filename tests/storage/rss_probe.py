"""Child process for the bounded-memory test: upload and download one big file, report peak RSS.

Run as `python -m tests.storage.rss_probe ENDPOINT ACCESS SECRET BUCKET SIZE PART CONCURRENCY DIR PHASE`
with PHASE `put` (upload a sparse file of SIZE bytes as `big`) or `get` (download `big`); each
phase runs in its own process so each has its own peak.
The baseline is taken after a small warm-up transfer, so imports, the HTTP session and the thread
pool are already counted; what the big transfer adds on top is what the test bounds. ru_maxrss is
a high-water mark, so a spike between samples cannot hide.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
from pathlib import Path

from storage.s3 import S3Store


def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


async def main(argv: list[str]) -> dict[str, int]:
    endpoint, access, secret, bucket = argv[:4]
    size, part, concurrency = (int(a) for a in argv[4:7])
    work = Path(argv[7])
    async with S3Store(endpoint, bucket, access, secret, part_size=part, concurrency=concurrency) as store:
        await store.ensure_bucket()
        warm = work / "warm"
        warm.write_bytes(os.urandom(part + 1))  # two parts: the multipart path warms up too
        await store.put_file("warm", warm)
        await store.get_file("warm", work / "warm.back")
        baseline = peak()
        if argv[8] == "put":
            big = work / "big"
            with open(big, "wb") as f:
                f.truncate(size)  # sparse: costs neither disk writes nor page cache up front
            await store.put_file("big", big)
            big.unlink()
        else:
            info = await store.get_file("big", work / "big.back")
            assert info.size == size == (work / "big.back").stat().st_size
            (work / "big.back").unlink()
    return {"baseline": baseline, "peak": peak()}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1:]))))
