"""issue 48: the Python API (`import gpupool`) against a real pool: a server with an S3 store and a
worker (tests/api/conftest.py), functions pickled here and run in the worker's jobs."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import cloudpickle
import pytest

import gpupool
from tests.api.conftest import ApiPool

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the jobs cannot import tests/

WAIT = 30.0


@pytest.fixture
def pool(as_alice: ApiPool) -> Iterator[gpupool.Pool]:
    with gpupool.connect(project=False) as pool:
        yield pool


def add(a: int, b: int) -> int:
    return a + b


def test_a_functions_result_comes_back(pool: gpupool.Pool) -> None:
    """issue 48, "a function's result returned": the function runs in a job, its value returns."""
    job = pool.submit(add, 2, b=3)
    assert job.result(WAIT) == 5


class Broken(ValueError):
    pass


def fail(message: str) -> None:
    raise Broken(message)


def test_an_exception_is_raised_again_with_the_remote_traceback(pool: gpupool.Pool) -> None:
    """issue 48, "an exception raised again with the remote traceback": the function's own
    exception type and message, its cause the job's traceback naming the line that raised."""
    job = pool.submit(fail, "no luck")
    with pytest.raises(Broken, match="no luck") as caught:
        job.result(WAIT)
    cause = caught.value.__cause__
    assert isinstance(cause, gpupool.RemoteTraceback)
    assert ", in fail\n" in cause.tb  # where the job raised it
    assert "Broken: no luck" in cause.tb
    assert isinstance(job.exception(0), Broken)
    assert job.state == "failed"


def square(x: int) -> int:
    return x * x


def test_map_sends_one_array_and_keeps_the_order(pool: gpupool.Pool) -> None:
    """issue 48, "map over 100 items as one array with results in order": one array id for all,
    each job its own index's call, the results in the order of the items."""
    jobs = pool.map(str, range(100))  # a builtin: a job's time is the pool's, not cloudpickle's import
    assert [job.result(WAIT) for job in jobs] == [str(x) for x in range(100)]
    arrays = {job.record()["spec"]["array"] for job in jobs[:3]}
    assert len(arrays) == 1


def test_a_command_runs_and_fails_with_its_log(pool: gpupool.Pool) -> None:
    """issue 48, `pool.run`: a command's result is its exit status; one that fails raises
    JobFailed naming the job, its state and the end of its log."""
    assert pool.run(["true"]).result(WAIT) == 0
    job = pool.run(["sh", "-c", "echo all went wrong; exit 3"])
    with pytest.raises(gpupool.JobFailed, match=rf"(?s)job {job.id} ended failed .*all went wrong"):
        job.result(WAIT)
