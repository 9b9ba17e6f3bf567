"""Memory stays bounded by parts in flight x part size, whatever the file size (issue 6).

The transfer runs in a child process so its peak RSS is its own (pytest, the S3 server and other
tests do not count), measured against a baseline taken after a warm-up transfer in that child.
Wall-clock speed is never asserted.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from storage.s3 import MiB
from tests.support.paths import ROOT
from tests.support.s3server import S3Server

PART = 8 * MiB
CONCURRENCY = 4


def transfer_peak_rss(server: S3Server, bucket: str, size: int, work: Path, phase: str) -> dict[str, int]:
    argv = [server.endpoint, server.access_key, server.secret_key, bucket]
    argv += [str(size), str(PART), str(CONCURRENCY), str(work), phase]
    out = subprocess.run(
        [sys.executable, "-m", "tests.storage.rss_probe", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    "size",
    [pytest.param(256 * MiB, id="256MiB"), pytest.param(1024 * MiB, id="1GiB", marks=pytest.mark.slow)],
)
def test_peak_rss_bounded_by_parts_in_flight(s3_server: S3Server, tmp_path: Path, size: int) -> None:
    window = CONCURRENCY * PART
    assert size >= 8 * window  # the bound means something only if the file is much bigger
    bucket = f"rss-{secrets.token_hex(4)}"
    for phase in ("put", "get"):
        r = transfer_peak_rss(s3_server, bucket, size, tmp_path, phase)
        added = r["peak"] - r["baseline"]
        print(
            f"{phase} {size / MiB:.0f} MiB: baseline {r['baseline'] / MiB:.0f} MiB, "
            f"peak {r['peak'] / MiB:.0f} MiB (+{added / MiB:.0f} MiB; window {window / MiB:.0f} MiB)"
        )
        assert added <= 3 * window, (phase, r)
