"""issue 48: the Python API (`import gpupool`) against a real pool: a server with an S3 store and a
worker (tests/api/conftest.py), functions pickled here and run in the worker's jobs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import gpupool
from daemon.client.pool_client import ClientError, PoolClient
from protocol import DownloadTicket, Enqueue, Enqueued, ErrorCode, PrepareDownload
from storage.content import content_key
from tests.api.conftest import ApiPool
from tests.support.paths import ROOT

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the jobs cannot import tests/

WAIT = 30.0


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


def test_a_system_exit_in_the_job_is_an_error_here_not_an_exit(pool: gpupool.Pool) -> None:
    """issue 48, a helper's finding: `sys.exit(3)` (or a KeyboardInterrupt) raised by the function
    came back and was raised again as it was, so `result()` ended the client's script (a notebook
    its cell, as an exit). An exception that is not an Exception comes back as a RemoteError
    saying what the job raised, with its traceback; the job failed."""
    job = pool.submit(sys.exit, 3)
    with pytest.raises(gpupool.RemoteError, match=r"the job raised SystemExit: 3") as caught:
        job.result(WAIT)
    assert isinstance(caught.value.__cause__, gpupool.RemoteTraceback)
    assert isinstance(job.exception(0), gpupool.RemoteError)
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


def sleep_then(seconds: float, value: object) -> object:
    import time

    time.sleep(seconds)
    return value


def test_cancel_stops_the_job_in_the_pool(pool: gpupool.Pool) -> None:
    """issue 48, "cancel": `job.cancel()` cancels the job in the pool (True), the future is
    cancelled with it, and the pool records the job as cancelled, whether it was queued or
    running (its process stopped); an ended job is not cancelled."""
    job = pool.submit(sleep_then, 60, "never")
    assert job.cancel()
    assert job.cancelled()
    with pytest.raises(concurrent.futures.CancelledError):
        job.result(WAIT)
    deadline = time.monotonic() + WAIT
    while job.state != "cancelled":
        assert time.monotonic() < deadline, f"job {job.id} still {job.state}"
        time.sleep(0.05)
    running = pool.submit(sleep_then, 60, "never")  # and one that runs: its process is stopped
    while running.state != "running":
        assert time.monotonic() < deadline, f"job {running.id} still {running.state}"
        time.sleep(0.05)
    assert running.cancel()
    while (state := running.state) != "cancelled":
        assert time.monotonic() < deadline, f"job {running.id} still {state}"
        time.sleep(0.05)
    assert running.record()["detail"].startswith("cancelled")
    done = pool.submit(add, 1, 1)
    assert done.result(WAIT) == 2
    assert not done.cancel()


def _python(code: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """A new Python process running `code` against the pool `env` names, from this checkout."""
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def _first_line(proc: subprocess.Popen[str], seconds: float) -> str:
    """The first line `proc` prints that is not empty, within `seconds`; else it is killed and
    the test fails with what it wrote on stderr (a bare readline waited without a bound)."""
    assert proc.stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(_lines_until_one(proc.stdout)), daemon=True)
    reader.start()
    reader.join(seconds)
    if not lines or not lines[-1].strip():
        proc.kill()
        err = proc.communicate(timeout=WAIT)[1]
        pytest.fail(f"no line printed in {seconds:.0f} s (exit {proc.returncode}); stderr: {err}")
    return lines[-1].strip()


def _lines_until_one(stream: Any) -> list[str]:
    read = []
    while line := stream.readline():
        read.append(line)
        if line.strip():
            break
    return read


BANNED_TOPS = ("redis", "aiobotocore", "botocore")
BANNED_ROOMS = ("daemon.server", "daemon.worker", "daemon.queue", "daemon.metrics", "daemon.object_store")


def test_a_job_is_found_again_by_its_id_from_another_process(pool: gpupool.Pool, api_pool: ApiPool) -> None:
    """issue 48, "reattach by id from a new process": a process that never submitted the job
    gets its result by its id alone (the result's artifact found from the job's record); and
    loads nothing gpupool/ruff.toml bans (ruff sees only import statements)."""
    job = pool.submit(sleep_then, 0.3, {"answer": 42})
    code = (
        f"import gpupool, sys; print(gpupool.connect(project=False).job({job.id!r}).result({WAIT})); "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {BANNED_TOPS!r} "
        f"or m.startswith({BANNED_ROOMS!r})))"
    )
    with _python(code, api_pool.env("alice")) as proc:
        out, err = proc.communicate(timeout=WAIT)
    assert proc.returncode == 0, err
    assert out.splitlines() == ["{'answer': 42}", "[]"]
    assert job.result(WAIT) == {"answer": 42}


CTRL_C = """
import gpupool, sys
pool = gpupool.connect(project=False)
job = pool.submit(lambda: __import__("time").sleep(60))
print(job.id, flush=True)
try:
    job.result(60)
except KeyboardInterrupt:
    print("interrupted", job.state, flush=True)
"""


def test_ctrl_c_interrupts_result_and_the_job_runs_on(pool: gpupool.Pool, api_pool: ApiPool) -> None:
    """issue 48, "Ctrl-C interrupts .result()": SIGINT to a process blocked in `result()` raises
    KeyboardInterrupt there at once, and the job goes on in the pool (cancelled here after)."""
    with _python(CTRL_C, api_pool.env("alice")) as proc:
        assert proc.stdout is not None
        job_id = _first_line(proc, 2 * WAIT)
        time.sleep(0.2)  # into the wait: a signal before it would be as good a test of nothing
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=WAIT)
    assert proc.returncode == 0, err
    assert out.split()[0] == "interrupted"
    assert out.split()[1] in ("queued", "running")
    assert pool.job(job_id).cancel()


def test_a_100_mb_result_comes_through_the_object_store(pool: gpupool.Pool) -> None:
    """issue 48, "a 100 MB result via the object store": the result is an artifact in the S3
    store, downloaded by presigned URL and checked against the recorded sha256."""
    job = pool.submit(bytes, 100 * 2**20)
    assert job.result(WAIT) == bytes(100 * 2**20)
    (artifact,) = [a for a in job.record()["result"]["artifacts"] if a["name"] == "gpupool/result.pickle"]
    assert artifact["size"] > 100 * 2**20


async def test_inside_a_running_event_loop(as_alice: ApiPool) -> None:
    """issue 48, "the API used inside a running event loop": blocking calls from a coroutine of
    a running loop (as in a notebook: connect, submit, result) work, and so does `await job`; a
    wait cut short cancels the job."""
    asyncio.get_running_loop()  # a loop runs here
    pool = gpupool.connect(project=False)
    try:
        assert pool.submit(add, 20, 22).result(WAIT) == 42
        assert await asyncio.wait_for(pool.submit(add, 1, 2), WAIT) == 3
        jobs = pool.map(str, [7, 8])
        assert await asyncio.gather(*jobs) == ["7", "8"]
        slow = pool.submit(sleep_then, 60, "late")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(slow, 0.1)
        assert slow.cancelled()
    finally:
        pool.close()


def test_another_user_cannot_read_a_jobs_call_or_result(pool: gpupool.Pool, api_pool: ApiPool) -> None:
    """issue 48, "another user cannot read a job's pickled input or result": bob is refused a
    download of alice's archive (its content key) and of her result's artifact key, a job of his
    that names her archive as its input, and a wait on her job."""
    job = pool.submit(add, 40, 2)
    assert job.result(WAIT) == 42
    record = job.record()
    (call,) = record["spec"]["inputs"]
    (result,) = [a for a in record["result"]["artifacts"] if a["name"] == "gpupool/result.pickle"]

    async def as_bob() -> list[int]:
        refused = []
        async with PoolClient(api_pool.address, "bob", api_pool.tokens["bob"]) as bob:
            for key in (content_key(call["sha256"]), result["key"]):
                with pytest.raises(ClientError) as caught:
                    await bob.call(PrepareDownload(key), DownloadTicket)
                refused.append(caught.value.code)
            spec = {k: v for k, v in record["spec"].items() if k != "user"}  # the server sets it
            with pytest.raises(ClientError) as caught:
                await bob.call(Enqueue(spec, None), Enqueued)
            refused.append(caught.value.code)
        return refused

    assert asyncio.run(as_bob()) == [ErrorCode.PERMISSION_DENIED] * 3
    with gpupool.connect(project=False, server=api_pool.address) as alice_again:
        assert alice_again.job(job.id).result(WAIT) == 42


def test_bob_cannot_reattach_alices_job(api_pool: ApiPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 48: `pool.job(id)` of another user's job is refused in a sentence (NotYours)."""
    for name, value in api_pool.env("alice").items():
        monkeypatch.setenv(name, value)
    with gpupool.connect(project=False) as alice:
        job = alice.submit(add, 1, 2)
    monkeypatch.setenv("GPUPOOL_USER", "bob")
    monkeypatch.setenv("GPUPOOL_TOKEN", api_pool.tokens["bob"])
    with gpupool.connect(project=False) as bob, pytest.raises(gpupool.Error, match="belongs to alice"):
        bob.job(job.id)


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (lambda pool: pool.submit(add, 1, 2, gpus=-1), r"gpus=-1: a whole number from 0 to 1024"),
        (lambda pool: pool.submit(add, 1, 2, gpu_mem="lots"), r"gpu_mem: 'lots' is not a size"),
        (lambda pool: pool.submit(add, 1, 2, cpus=-1), r"cpus=-1: a whole number from 0 to 4096"),  # issue 50
        (lambda pool: pool.submit(add, 1, 2, mem="lots"), r"mem: 'lots' is not a size"),
        # issue 50, a review's finding 12: 4096 bytes, a job killed by its own limit at once
        (
            lambda pool: pool.submit(add, 1, 2, mem=4096),
            r"mem: '4096' is 4096 bytes, less than a MiB: give a unit",
        ),
        (
            lambda pool: pool.submit(add, 1, 2, queue="nowhere"),
            r"^no worker of this pool serves queue 'nowhere' .*Enqueue it with wait_for_worker=True to keep",
        ),
        (lambda pool: pool.submit(42), r"42 is not callable"),
        (lambda pool: pool.submit(add, threading.Lock(), 2), r"the arguments of add cannot be pickled"),
        (lambda pool: pool.map(add, [1], retries="x"), r"retries='x': a whole number"),
        (lambda pool: pool.executor(gpu=1), r"no job option 'gpu'"),
        (lambda pool: pool.map(str, range(10_001)), r"at most 10000 in one array"),
        (lambda pool: pool.run("python train.py"), r"the command as a list of strings"),
        (lambda pool: pool.job("default.nosuchjob"), r"no job 'default.nosuchjob' in this pool"),
    ],
)
def test_a_bad_argument_is_a_sentence(pool: gpupool.Pool, call: Any, said: str) -> None:
    """issue 48, errors: a bad argument raises gpupool.BadArgument with a sentence saying what was
    wrong, never a traceback from deep inside (no chained cause); nothing is queued."""
    with pytest.raises(gpupool.BadArgument, match=said) as caught:
        call(pool)
    assert caught.value.__cause__ is None
    assert caught.value.__suppress_context__ or caught.value.__context__ is None


def where(x: int) -> tuple[str, int]:
    import os

    return os.getcwd(), x + 1


def test_a_function_runs_in_a_copy_of_the_clients_project(
    pool: gpupool.Pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 48, "the job runs in the project the client is in": a function of the project's own
    module, pickled by reference, is imported in the job from the project's copy, started in the
    same directory within it as the client (the archive found from there)."""
    (tmp_path / "proj" / "sub").mkdir(parents=True)
    (tmp_path / "proj" / "requirements.txt").write_text("")  # a project's marker, and no lock
    (tmp_path / "proj" / "sub" / "project_mod.py").write_text(
        "import os\n\ndef here(x):\n    return os.path.basename(os.getcwd()), __name__, x * 2\n"
    )
    monkeypatch.chdir(tmp_path / "proj" / "sub")
    monkeypatch.syspath_prepend(str(tmp_path / "proj" / "sub"))
    import project_mod  # type: ignore[import-not-found]

    job = pool.submit_with(pool.defaults.replace(project=True), project_mod.here, (21,), {})
    assert job.result(WAIT) == ("sub", "project_mod", 42)
    assert job.record()["spec"]["project"]["dir"] == "sub"


def shout(text: str) -> str:
    import os
    import pathlib

    print(f"saying {text}", flush=True)
    pathlib.Path(os.environ["GPUPOOL_OUTPUT"], "said.txt").write_text(text)
    return text.upper()


def test_logs_artifacts_and_the_executor(pool: gpupool.Pool, tmp_path: Path) -> None:
    """issue 48: `logs()` holds what the function printed, `artifacts(dest)` brings back what it
    left in $GPUPOOL_OUTPUT, and `executor()` is a concurrent.futures.Executor of Jobs that works
    with `wait` and `as_completed`, its `map` over several iterables in order."""
    with pool.executor(timeout=60) as ex:
        job = ex.submit(shout, "hi")
        assert isinstance(job, gpupool.Job)
        assert list(ex.map(add, [1, 2], [10, 20])) == [11, 22]
        assert next(concurrent.futures.as_completed([job], WAIT)).result() == "HI"
    assert "saying hi" in job.logs()
    assert "saying hi" in "".join(job.logs(follow=True))
    paths = job.artifacts(tmp_path / "got")
    assert (tmp_path / "got" / "said.txt").read_text() == "hi"
    assert tmp_path / "got" / "said.txt" in paths


def test_the_readmes_from_python_example_runs(
    as_alice: ApiPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 48, README's "From Python": its example (the block marked doc-test: from-python) runs
    as written against a real pool, here from a directory outside any project."""
    readme = (ROOT / "README.md").read_text()
    (block,) = re.findall(r"<!-- doc-test: from-python -->\n```python\n(.*?)\n```", readme, re.S)
    monkeypatch.chdir(tmp_path)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        exec(compile(block, "README.md", "exec"), {"__name__": "readme_example"})
    job_line, loss_line = said.getvalue().splitlines()
    assert job_line.startswith("default.")
    assert float(loss_line) == pytest.approx(0.99**50)
