"""The test suite itself never hangs (issue 12 item 14): a test that fails in set-up ends, and one
whose teardown hangs ends the run with every thread's stack rather than sit until CI's limit.
Each case runs pytest in a child process, with this suite's conftest, on a test written here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.paths import ROOT

FAILING_START = """
import socket

from tests.support.pool import running_pool


async def test_a_pool_whose_metrics_port_is_taken(redis_server, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        async with running_pool(redis_server, tmp_path, metrics_listen=f"127.0.0.1:{port}"):
            pass
"""

HANGING_TEARDOWN = """
import threading

import pytest


@pytest.fixture
def stuck():
    yield
    while True:  # a teardown that never returns, as one blocked in C (uvloop's close) does not
        try:
            threading.Event().wait()
        except BaseException:  # pytest-timeout's Failed included: it cannot end this one
            pass


@pytest.mark.timeout(1)
def test_with_a_stuck_teardown(stuck):
    pass
"""


def run_pytest(tmp_path: Path, source: str, **env: str) -> subprocess.CompletedProcess[str]:
    test = tmp_path / "test_case.py"
    test.write_text(source)
    argv = [sys.executable, "-m", "pytest", "-q", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT)]
    argv += ["-p", "tests.conftest", "-p", "no:cacheprovider", str(test)]
    return subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=90, env={**os.environ, **env}, check=False
    )


def test_a_server_that_fails_to_start_leaves_nothing_to_hang_on(tmp_path: Path) -> None:
    """A pool server that failed half-way through its start (a taken metrics port) left its
    listener and tasks behind, and closing the test's event loop then waited for ever."""
    done = run_pytest(tmp_path, FAILING_START)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "cannot serve metrics" in done.stdout


def test_a_teardown_that_hangs_ends_the_run_with_the_stacks(tmp_path: Path) -> None:
    done = run_pytest(tmp_path, HANGING_TEARDOWN, GPUPOOL_TEST_TEARDOWN_GRACE="2")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "has not ended 3 s after it began" in done.stderr
    assert "in stuck" in done.stderr  # the stack of the stuck teardown
