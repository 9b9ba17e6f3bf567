"""Bench programs run at their smallest size, so that none rots between runs of `make bench`: each
must finish and say what it measured. Nothing here asserts a speed (the machine is shared)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.paths import ROOT


@pytest.mark.parametrize(
    ("program", "says"),
    [
        ("bench.agent_start", "agent / worker"),  # issue 44 item 1: a start on an agent
        ("bench.env_start", "cold_hermetic"),  # issue 45 item 2: hermetic only, no network
        ("bench.policies", "ratio to FIFO"),  # issue 46: the scheduler's parts, each policy's cost
    ],
)
def test_a_bench_program_runs_at_its_smallest(program: str, says: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", program, "--quick"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert says in done.stdout, done.stdout[-3000:]
