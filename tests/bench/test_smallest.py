"""Bench programs run at their smallest size, so that none rots between runs of `make bench`: each
must finish and say what it measured. Nothing here asserts a speed (the machine is shared)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.paths import ROOT


@pytest.mark.parametrize(
    ("program", "says", "size"),
    [
        ("bench.agent_start", "agent / worker", ["--quick"]),  # issue 44 item 1: a start on an agent
        ("bench.env_start", "cold_hermetic", ["--quick"]),  # issue 45 item 2: hermetic only, no network
        # issue 46: the scheduler's parts, each policy's cost
        ("bench.policies", "ratio to FIFO", ["--jobs", "200", "--rounds", "1"]),
        # issue 48: a function's round trip through the Python API, beside submitit on Slurm
        ("bench.python_api", "round trip p50", ["--quick"]),
        # issue 49: a keystroke's echo and a forwarded port's throughput through the pool's relay,
        # beside direct TCP and ssh to a private sshd (where openssh-server is installed)
        ("bench.interactive", "keystroke echo", ["--quick"]),
        # issue 50: the GPU health fields NVML gives (here, without a GPU, it says so)
        ("bench.gpu.health_check", "GPU health fields", ["--watch", "0.1"]),
    ],
)
def test_a_bench_program_runs_at_its_smallest(program: str, says: str, size: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", program, *size],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert says in done.stdout, done.stdout[-3000:]
