"""issue 48, a reviewer's findings on the Python API: whose pickles it loads, and where; futures
that must not fail while their jobs run on (a server restarting, many Pools, many ids); the
threads their outcomes are set and loaded on; a Pool in a forked child. Against a real pool
(tests/api/conftest.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import pathlib
import pickle
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import gpupool
import gpupool.watch
from daemon.server import handlers
from tests.api.conftest import ApiPool
from tests.support.paths import ROOT

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the jobs cannot import tests/

WAIT = 30.0


def add(a: int, b: int) -> int:
    return a + b


def sleep_then(seconds: float, value: object) -> object:
    import time

    time.sleep(seconds)
    return value


class Touches:
    """Unpickled, it creates `path`: what a pickle can do to the process that loads it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def as_user(api_pool: ApiPool, user: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPOOL_USER", user)
    monkeypatch.setenv("GPUPOOL_TOKEN", api_pool.tokens[user])


def test_an_admin_never_loads_another_users_result(
    pool: gpupool.Pool, api_pool: ApiPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 48, review finding 1: an admin reattaching alice's job (`pool.job(id)`, as a submitit
    job unpickled does) never unpickles her result, a pickle her job wrote that would run as the
    admin here: result() refuses in a sentence; artifacts(dest) still downloads it as a file."""
    marker = tmp_path / "alice-code-ran-here"
    job = pool.submit(Touches, str(marker))
    concurrent.futures.wait([job], WAIT)  # ended; its bytes not loaded by alice's client either
    as_user(api_pool, "carol", monkeypatch)
    with gpupool.connect(project=False) as carol:
        theirs = carol.job(job.id)
        with pytest.raises(gpupool.Error, match=rf"job {job.id} belongs to alice: its result is a pickle"):
            theirs.result(WAIT)
        assert not marker.exists()
        assert tmp_path / "got" / "gpupool" / "result.pickle" in theirs.artifacts(tmp_path / "got")
    assert not marker.exists()


def test_a_commands_files_are_never_unpickled(pool: gpupool.Pool, tmp_path: Path) -> None:
    """issue 48, review finding 2: a command's job (pool.run, or a poolctl job reattached) that
    leaves a file named as a function's outcome has an exit status for its result: the file is
    never unpickled, whether the job is waited for by the Pool that ran it or reattached."""
    marker = tmp_path / "a-commands-output-ran-here"
    forged = pickle.dumps(("returned", "", pickle.dumps(Touches(str(marker)))))
    write = (
        "import os, pathlib; d = pathlib.Path(os.environ['GPUPOOL_OUTPUT'], 'gpupool'); d.mkdir(); "
        f"(d / 'result.pickle').write_bytes(bytes.fromhex({forged.hex()!r}))"
    )
    job = pool.run(["python", "-c", write])
    assert job.result(WAIT) == 0
    with gpupool.connect(project=False) as other:
        assert other.job(job.id).result(WAIT) == 0
    assert not marker.exists()
    assert "gpupool/result.pickle" in [a["name"] for a in job.record()["result"]["artifacts"]]


def test_a_result_not_what_the_job_stored_is_refused(
    pool: gpupool.Pool, api_pool: ApiPool, tmp_path: Path
) -> None:
    """issue 48, review finding 14: a result whose stored bytes are not those whose sha256 the
    worker recorded (changed in the object store) is refused before it is unpickled."""
    job = pool.submit(add, 1, 2)
    concurrent.futures.wait([job], WAIT)
    (item,) = [a for a in job.record()["result"]["artifacts"] if a["name"] == "gpupool/result.pickle"]
    marker = tmp_path / "swapped-bytes-ran-here"
    swapped = pickle.dumps(("returned", "", pickle.dumps(Touches(str(marker)))))
    store = api_pool.server.store
    asyncio.run_coroutine_threadsafe(store.put_bytes(item["key"], swapped), api_pool.loop).result(WAIT)
    with gpupool.connect(project=False) as other, pytest.raises(gpupool.Error, match="sha256"):
        other.job(job.id).result(WAIT)
    assert not marker.exists()


# The restarted listener can leave one server-side transport of a connection cut as it stopped
# to the garbage collector (threaded_pool.py restart() says what is known): its warning, when the
# collector runs in this test, is the listener's, not what this test checks.
@pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_server_restart_is_waited_out(pool: gpupool.Pool, api_pool: ApiPool) -> None:
    """issue 48, review finding 3: the server stopping (every connection closed) and starting
    again on the same address 4 s later does not fail the future of a job that runs on meanwhile:
    its result still comes."""
    job = pool.submit(sleep_then, 1, "after the restart")
    api_pool.restart(down_seconds=4)
    assert job.result(WAIT) == "after the restart"


def test_many_pools_share_one_blocking_read(as_alice: ApiPool, api_pool: ApiPool) -> None:
    """issue 48, review finding 4: 20 Pools of one process, each waiting for a job, hold one of
    the user's 16 blocking reads between them, not one each (the 17th Pool's futures failed)."""
    pools = [gpupool.connect(project=False) for _ in range(20)]
    try:
        jobs = [p.submit(sleep_then, 60, i) for i, p in enumerate(pools)]
        assert api_pool.server.handlers is not None
        blocking = api_pool.server.handlers._blocking
        deadline = time.monotonic() + WAIT
        while not blocking["alice"]:
            assert time.monotonic() < deadline, "no wait for the jobs began"
            time.sleep(0.05)
        time.sleep(0.5)  # the watches of the others, if they had their own, start meanwhile
        assert blocking["alice"] == 1
        assert not any(job.done() for job in jobs)
    finally:
        for p, job in zip(pools, jobs, strict=True):
            job.cancel()
            p.close()


def test_more_ids_than_one_wait_holds_are_waited_for_in_parts(
    pool: gpupool.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 48, review finding 4: more jobs waited for than the server takes in one request (its
    MAX_IDS, here 3 on both sides) are waited for in parts: every result comes (one request of all
    was refused, and every future failed)."""
    assert gpupool.watch.MAX_IDS == handlers.MAX_IDS
    monkeypatch.setattr(handlers, "MAX_IDS", 3)
    monkeypatch.setattr(gpupool.watch, "MAX_IDS", 3)
    jobs = pool.map(str, range(8))
    assert [job.result(WAIT) for job in jobs] == [str(i) for i in range(8)]


def only_the_job_has(tmp: str) -> object:
    import importlib
    import pathlib
    import sys

    pathlib.Path(tmp, "only_in_the_job.py").write_text("class Thing:\n    pass\n")
    sys.path.insert(0, tmp)
    return importlib.import_module("only_in_the_job").Thing()


class LoadedAsItsThread:
    """Unpickled, it is the thread that unpickles it."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (threading.current_thread, ())


def test_a_result_is_loaded_in_the_callers_thread(pool: gpupool.Pool) -> None:
    """issue 48, review finding 5: the outcome is unpickled in the thread that asks for it, never
    on the API's loop (where an import lock the caller holds deadlocked the process): a result
    that unpickles to the thread loading it is the caller's, in result() and in `await job`; and
    one that cannot be loaded here is said to be so, the job having succeeded."""
    job = pool.submit(LoadedAsItsThread)
    assert job.result(WAIT) is threading.current_thread()

    async def awaited() -> object:
        return await pool.submit(LoadedAsItsThread)

    assert asyncio.run(awaited()) is threading.current_thread()
    odd = pool.submit(only_the_job_has, "/tmp")
    match = rf"job {odd.id} succeeded but its result cannot be loaded here \(ModuleNotFoundError"
    with pytest.raises(gpupool.RemoteError, match=match):
        odd.result(WAIT)
    assert isinstance(odd.exception(0), gpupool.RemoteError)


def test_a_done_callback_may_submit_and_wait(pool: gpupool.Pool) -> None:
    """issue 48, review finding 6: futures are settled off the API's loop, so a done-callback that
    submits the next job and waits for it works (on the loop it raised "would never return",
    dropped silently by concurrent.futures)."""
    chained: queue.Queue[object] = queue.Queue()
    first = pool.submit(add, 1, 2)
    first.add_done_callback(lambda f: chained.put(pool.submit(add, f.result(), 10).result(WAIT)))
    assert chained.get(timeout=WAIT) == 13


def test_a_pool_in_a_forked_child_refuses_in_a_sentence(pool: gpupool.Pool) -> None:
    """issue 48, review finding 7: a Pool used in a forked child raises at once, saying to
    connect in the child (it hung, sharing the parent's socket); the parent's Pool works on."""
    assert pool.submit(add, 1, 1).result(WAIT) == 2
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: says what submit did, and ends without running the parent's exit
        try:
            pool.submit(add, 2, 2)
            told = b"submitted"
        except gpupool.Error as exc:
            told = str(exc).encode()
        os.write(write, told)
        pool.close()
        os._exit(0)
    os.close(write)
    try:
        ready = concurrent.futures.ThreadPoolExecutor(1).submit(os.read, read, 4096)
        said = ready.result(WAIT).decode()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(read)
    assert said.startswith(f"this Pool belongs to process {os.getpid()}: gpupool.connect() in the child")
    assert pool.submit(add, 3, 3).result(WAIT) == 6


def interrupted_sleep() -> None:
    import time

    time.sleep(60)


def test_a_timeout_is_not_reported_as_the_calls_keyboardinterrupt(pool: gpupool.Pool) -> None:
    """issue 48, review finding 8: a job stopped for its timeout with stop_signal="INT" (the
    function interrupted by KeyboardInterrupt) raises JobFailed saying it timed out, the job's
    traceback its cause, not "the job raised KeyboardInterrupt"."""
    job = pool.executor(timeout=1, stop_signal="INT").submit(interrupted_sleep)
    with pytest.raises(
        gpupool.JobFailed, match=rf"job {job.id} ended failed \(timed out after 1 s"
    ) as caught:
        job.result(WAIT)
    assert isinstance(caught.value.__cause__, gpupool.RemoteTraceback)
    assert "KeyboardInterrupt" in caught.value.__cause__.tb


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (lambda pool: pool.submit(add, 1, 2, retries=2), r"^retries= is a job option that submit does not"),
        (lambda pool: pool.job("x y"), r"^pool.job\('x y'\): a job's id, QUEUE.ID"),
        (lambda pool: pool.job(""), r"^pool.job\(''\): a job's id"),
        (
            lambda pool: gpupool.connect(server="127.0.0.1:1"),
            r"point gpupool.connect at yours with server='HOST:PORT'",
        ),
    ],
)
def test_a_mistake_is_said_in_the_apis_words(pool: gpupool.Pool, call: Any, said: str) -> None:
    """issue 48, review findings 10 and 13: a job option submit does not take is refused (it went
    to the function, which failed in the job), an id that cannot be one is a BadArgument, and a
    pool that does not answer is told in the API's keywords, not poolctl's flags."""
    with pytest.raises(gpupool.Error, match=said) as caught:
        call(pool)
    assert "--" not in str(caught.value)


def test_none_clears_a_pools_default(as_alice: ApiPool) -> None:
    """issue 48, review finding 10: an option given as None to submit clears the pool's default
    (it was taken as "not given", so connect(gpu_mem="20G") then submit(fn, gpus=1) could not
    be asked for)."""
    with gpupool.connect(project=False, name="fixed") as pool:
        assert pool.submit(add, 1, 2).record()["spec"]["name"] == "fixed"
        job = pool.submit(add, 1, 2, name=None)
        assert job.record()["spec"]["name"] == "add"
        assert job.result(WAIT) == 3


LEFT_OPEN = """
import gpupool
pool = gpupool.connect(project=False)
job = pool.submit(__import__("time").sleep, 60)
print(job.id, flush=True)
"""


def test_a_pool_left_open_is_closed_at_exit(pool: gpupool.Pool, api_pool: ApiPool) -> None:
    """issue 48, review finding 9: a script that ends with its Pool open and a job waited for
    exits at once and quietly (asyncio printed "Task was destroyed but it is pending!"); the
    job runs on."""
    proc = subprocess.run(
        [sys.executable, "-c", LEFT_OPEN], env=api_pool.env("alice"), cwd=ROOT,
        capture_output=True, text=True, timeout=WAIT, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    job = pool.job(proc.stdout.strip())
    assert job.state in ("queued", "running")
    assert job.cancel()


def test_a_pool_closed_while_a_result_comes_says_which_job(as_alice: ApiPool) -> None:
    """issue 48, review finding 12: close() while a job's result is being fetched (or before it
    ended) fails that Job with a sentence naming it and how to get it again, not "the client
    closed this connection"."""
    pool = gpupool.connect(project=False)
    try:
        job = pool.submit(bytes, 60 * 2**20)
        deadline = time.monotonic() + WAIT
        while job.record()["state"] != "succeeded":
            assert time.monotonic() < deadline, f"job {job.id} has not ended"
            time.sleep(0.02)
    finally:
        pool.close()
    with pytest.raises(
        gpupool.Error, match=rf"^the pool was closed (before|while the result of) job {job.id}"
    ):
        job.result(WAIT)
    with gpupool.connect(project=False) as again:
        assert len(again.job(job.id).result(WAIT)) == 60 * 2**20
