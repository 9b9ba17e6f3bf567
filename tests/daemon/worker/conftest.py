"""The worker's tests of claims, outcomes and drains run both ways: with the GPU-less fast path on
(the default) and off (issue 46; daemon/queue/fast_path.py, daemon/worker/fast_path.py), so that
the plain path stays the truth the fast one is checked against. A test marked `both_paths` gets
`fast_path` as a parameter, True then False; the `queue` fixture, and each JobQueue such a test
makes itself, is built with it. Only the quick tests of those three things are marked, so that
`make test` takes seconds longer, not twice as long."""

from __future__ import annotations

import pytest


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker("both_paths") is not None:
        assert "fast_path" in metafunc.fixturenames, f"{metafunc.function.__name__}: both_paths needs a queue"
        metafunc.parametrize("fast_path", [True, False], ids=["fast_path", "plain_path"])
