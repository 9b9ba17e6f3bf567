"""issue 48: submitit's own API on a real pool (tests/api/conftest.py): `submitit.AutoExecutor(folder,
cluster="gpupool")` found through gpupool's entry points, its parameters mapped, submit, map_array,
result, cancel, state, and checkpoint-and-requeue, the calls pickled here and run in the worker's
jobs."""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import submitit
from submitit.core import plugins
from submitit.core.utils import FailedJobError, UncompletedJobError

import gpupool
from gpupool_submitit.job import GpupoolJob
from tests.api.conftest import ApiPool
from tests.support.paths import ROOT

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the jobs cannot import tests/

WAIT = 30.0


@pytest.fixture
def executor(pool: gpupool.Pool, tmp_path: Path) -> submitit.AutoExecutor:
    assert "gpupool" in plugins.get_executors(), (
        "submitit finds no gpupool cluster: the installed metadata predates its entry points "
        "(pip install -e . again)"
    )
    return submitit.AutoExecutor(tmp_path, cluster="gpupool", gpupool_pool=pool)


def inside() -> dict[str, Any]:
    """What the job sees: submitit's JobEnvironment. (Where gpupool is installed, as in the worker's
    own Python these tests' jobs run with, submitit's entry points import it there too; where it
    is not, the call's module, which goes by value, registers the environment itself.)"""
    env = submitit.JobEnvironment()
    return {"cluster": env.cluster, "job_id": env.job_id, "rank": env.global_rank}


def fail(message: str) -> None:
    raise ValueError(message)


def test_auto_executor_runs_a_call_through_gpupool_with_submitits_parameters(
    executor: submitit.AutoExecutor, pool: gpupool.Pool
) -> None:
    """issue 48, "AutoExecutor(cluster="gpupool"), submit, job.result()": the cluster is found
    through the entry points; timeout_min, gpus_per_node and name become the job's timeout, GPUs
    and name, gpupool_queue and gpupool_stop_grace its own, and mem_gb (which gpupool cannot
    honour) warns; the call runs in a job whose submitit.JobEnvironment is gpupool's; its result
    and state come back; an exception (SystemExit too) comes back as submitit's FailedJobError
    with the job's traceback."""
    assert submitit.AutoExecutor.which() != "gpupool"  # only when named: nobody's default moves
    with pytest.warns(UserWarning, match="mem_gb is ignored on gpupool"):
        executor.update_parameters(
            timeout_min=2,
            gpus_per_node=0,
            name="where",
            mem_gb=4,
            gpupool_queue="default",
            gpupool_stop_grace=7,
        )
    job = executor.submit(inside)
    assert isinstance(job, GpupoolJob)
    seen = within(job)
    assert seen == {"cluster": "gpupool", "job_id": job.job_id, "rank": 0}
    assert job.done()
    assert job.state == "COMPLETED"
    spec = pool.job(job.job_id).record()["spec"]
    assert (spec["timeout"], spec["gpus"], spec["name"], spec["queue"]) == (120, 0, "where", "default")
    assert spec["stop_grace"] == 7

    failing = executor.submit(fail, "no luck")
    with pytest.raises(FailedJobError, match=r"(?s)in fail\n.*ValueError: no luck") as caught:
        within(failing)
    assert isinstance(caught.value.__cause__, ValueError)
    assert isinstance(failing.exception(), FailedJobError)
    assert failing.state == "FAILED"
    exiting = executor.submit(sys.exit, 3)  # raised again here, it would end this process
    with pytest.raises(FailedJobError, match="SystemExit: 3"):
        within(exiting)


def add(a: int, b: int) -> int:
    return a + b


def test_map_array_is_one_gpupool_array(executor: submitit.AutoExecutor, pool: gpupool.Pool) -> None:
    """issue 48, "map_array (as ONE gpupool array)": one array id for all its jobs, the results in
    the order of the arguments, each job named for the function; the submissions of a `with
    executor.batch()` are one array as well."""
    jobs = executor.map_array(add, [1, 2, 3, 4], [10, 20, 30, 40])
    with executor.batch():
        batched = [executor.submit(add, 5, 5), executor.submit(add, 6, 6)]
    assert [within(job) for job in jobs + batched] == [11, 22, 33, 44, 10, 12]
    specs = [pool.job(job.job_id).record()["spec"] for job in jobs]
    assert len({spec["array"] for spec in specs}) == 1
    assert {spec["name"] for spec in specs} == {"add"}
    assert len({pool.job(job.job_id).record()["spec"]["array"] for job in batched}) == 1


def nap(seconds: float) -> None:
    print("started", flush=True)
    time.sleep(seconds)


def test_a_pickled_job_is_followed_again_from_another_process(
    executor: submitit.AutoExecutor, api_pool: ApiPool, tmp_path: Path
) -> None:
    """issue 48, "reattach", as submitit users do it: a Job pickled here and unpickled in a new
    process follows the same gpupool job there, through a connection of its own, to its result."""
    job = executor.submit(add, 2, 3)
    (tmp_path / "job.pkl").write_bytes(pickle.dumps(job))
    again = "import pickle, sys; job = pickle.load(open(sys.argv[1], 'rb')); print(job.result(), job.state)"
    done = subprocess.run(
        [sys.executable, "-c", again, str(tmp_path / "job.pkl")],
        env={**api_pool.env("alice"), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=False,
    )
    assert (done.returncode, done.stdout) == (0, "5 COMPLETED\n"), done.stderr


def test_cancel_stops_the_job_and_its_result_says_so(
    executor: submitit.AutoExecutor, pool: gpupool.Pool
) -> None:
    """issue 48, "job.cancel()": a running job is stopped in the pool: done, CANCELLED, and its
    result raises submitit's UncompletedJobError."""
    job = executor.submit(nap, 60)
    wait_for_line(pool, job.job_id, "started")
    assert job.state == "RUNNING"
    job.cancel()
    assert job.done()
    with pytest.raises(UncompletedJobError, match=f"job {job.job_id} has no result"):
        within(job)
    deadline = time.monotonic() + WAIT
    while job.state != "CANCELLED" and time.monotonic() < deadline:  # its process stops first
        time.sleep(0.05)
    assert job.state == "CANCELLED"


class Steps(submitit.helpers.Checkpointable):
    """Counts to `total`, noting which attempt made each step; the first attempt stops after
    three and waits to be stopped. Checkpointable's checkpoint() resubmits this object as it is."""

    def __init__(self) -> None:
        self.made: list[int] = []

    def __call__(self, total: int) -> list[int]:
        attempt = int(os.environ["GPUPOOL_ATTEMPT"])
        while len(self.made) < total:
            self.made.append(attempt)
            print(f"step {len(self.made)}", flush=True)
            if attempt == 1 and len(self.made) == 3:
                time.sleep(60)  # until the requeue's stop signal
        return self.made


def wait_for_line(pool: gpupool.Pool, job_id: str, line: str) -> None:
    """Follow the job's log until `line` has been printed: an AssertionError after WAIT seconds
    (the follow, in a thread of its own, is given up), not a hang."""
    seen: concurrent.futures.Future[None] = concurrent.futures.Future()

    def follow() -> None:
        log = ""
        for chunk in pool.job(job_id).logs(follow=True):
            log += chunk
            if f"{line}\n" in log:
                seen.set_result(None)
                return
        seen.set_exception(AssertionError(f"job {job_id} ended without printing {line!r}: {log}"))

    threading.Thread(target=follow, name=f"follow-{job_id}", daemon=True).start()
    seen.result(WAIT)


def within(job: Any, seconds: float = WAIT) -> Any:
    """submitit's `job.result()` (which takes no timeout) once the job is done: an AssertionError
    after `seconds`, not a hang."""
    deadline = time.monotonic() + seconds
    while not job.done():
        assert time.monotonic() < deadline, f"job {job.job_id} not done after {seconds} s"
        time.sleep(0.05)
    return job.result()


def poolctl(api_pool: ApiPool, *args: str) -> None:
    """`poolctl ARGS` as alice, from another process, as a researcher would stop a job."""
    done = subprocess.run(
        [sys.executable, "-m", "daemon.ctl.cli", *args],
        env={**api_pool.env("alice"), "PYTHONPATH": str(ROOT)},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_a_checkpointable_call_requeued_mid_run_resumes_from_its_checkpoint(
    executor: submitit.AutoExecutor, pool: gpupool.Pool, api_pool: ApiPool
) -> None:
    """issue 48, "checkpoint-and-requeue": `poolctl requeue` stops the job mid-run; its stop signal
    has the callable checkpointed into $GPUPOOL_CHECKPOINT_DIR, and the next attempt, restored from
    it, goes on from step 4: a start over would have made every step in attempt 2."""
    job = executor.submit(Steps(), 5)
    wait_for_line(pool, job.job_id, "step 3")
    poolctl(api_pool, "requeue", job.job_id)
    assert within(job) == [1, 1, 1, 2, 2]
    assert "step 5\n" in (job.stdout() or "")


def test_parameters_gpupool_cannot_honour_are_refused_with_a_sentence(tmp_path: Path) -> None:
    """issue 48, parameters mapped: several tasks or nodes per call are refused before anything is
    submitted, naming what to do instead (no pool needed: nothing is sent)."""
    executor = submitit.AutoExecutor(tmp_path, cluster="gpupool")
    with pytest.raises(ValueError, match=r"nodes=2: .* leave nodes at 1"):
        executor.update_parameters(nodes=2)
    with pytest.raises(ValueError, match=r"tasks_per_node=4: .* leave tasks_per_node at 1"):
        executor.update_parameters(tasks_per_node=4)


def test_a_checkpointable_call_cancelled_by_poolctl_has_no_result(
    executor: submitit.AutoExecutor, pool: gpupool.Pool, api_pool: ApiPool
) -> None:
    """issue 48, the stop signal wired: a job stopped for good (`poolctl cancel` from another
    process here; a timeout alike) after its checkpoint was saved ends as the signal ends it, with
    no result, so `result()` raises UncompletedJobError (not the SystemExit a handler that
    exits would leave behind as the call's outcome, raised again here)."""
    job = executor.submit(Steps(), 5)
    wait_for_line(pool, job.job_id, "step 3")
    poolctl(api_pool, "cancel", job.job_id)
    with pytest.raises(UncompletedJobError, match=f"job {job.job_id} has no result"):
        within(job)
    assert job.state == "CANCELLED"
