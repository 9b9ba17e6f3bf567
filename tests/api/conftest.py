"""One real pool for a test module of the Python API (tests/support/threaded_pool.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import gpupool
from tests.support.s3server import S3Server
from tests.support.threaded_pool import ThreadedPool, threaded_pool

ApiPool = ThreadedPool


@pytest.fixture(scope="module")
def api_pool(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[ApiPool]:
    with threaded_pool(tmp_path_factory.mktemp("api"), s3_server) as pool:
        yield pool


@pytest.fixture
def as_alice(api_pool: ApiPool, monkeypatch: pytest.MonkeyPatch) -> ApiPool:
    """This process reaches the module's pool as alice (GPUPOOL_* in its environment)."""
    for name, value in api_pool.env("alice").items():
        if name != "PATH":
            monkeypatch.setenv(name, value)
    return api_pool


@pytest.fixture
def pool(as_alice: ApiPool) -> Iterator[gpupool.Pool]:
    """A Pool of this process's, as alice, its jobs in a scratch directory (project=False)."""
    with gpupool.connect(project=False) as pool:
        yield pool
