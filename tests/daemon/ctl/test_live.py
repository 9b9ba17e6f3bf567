"""Live views (daemon/ctl/live.py): `poolctl top`, `ls --watch`, and `wait` over many jobs, each
one streamed request to a real server (WatchPool, WaitJobs), piped and on a terminal."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson

from daemon.job import JobState, Outcome
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.registry import list_workers
from protocol import (
    CancelJobs,
    Cancelled,
    Enqueue,
    EnqueueBatch,
    Enqueued,
    EnqueuedBatch,
    JobEnded,
    PoolView,
    Waited,
    WaitJobs,
    WatchEnded,
    WatchPool,
)
from tests.daemon.ctl.test_render import HOSTILE, hostile_job, in_a_terminal
from tests.support.paths import ROOT
from tests.support.pool import Pool
from tests.support.poolctl import poolctl
from tests.support.workers import JOBS_AS_ROOT


async def test_one_watch_request_streams_views_that_follow_the_pool(pool: Pool) -> None:
    """The views come over one request; a job queued between two of them is in the second."""
    async with pool.client() as c:
        views: list[PoolView] = []
        end = None
        async for item in c.stream(WatchPool(None, None, False, 100, 0.5, 2)):
            if isinstance(item, PoolView):
                views.append(item)
                if len(views) == 1:  # on another connection: the watch's own one is busy
                    async with pool.client() as other:
                        await other.call(Enqueue({"argv": ["true"]}, None), Enqueued)
            else:
                end = item
    assert end == WatchEnded(2)
    assert [len(v.jobs) for v in views] == [0, 1]
    assert views[1].at - views[0].at >= 0.4  # the interval asked for (the server's floor is 0.5 s)


async def test_wait_streams_each_job_as_it_ends(pool: Pool) -> None:
    async with pool.client() as c:
        first, second = (await c.call(EnqueueBatch([{"argv": ["true"]}] * 2), EnqueuedBatch)).job_ids
        await c.call(CancelJobs([first]), Cancelled)
        ended: list[str] = []
        got_first = asyncio.Event()

        async def wait() -> Waited | None:
            async with pool.client() as w:
                async for item in w.stream(WaitJobs([first, second], 30)):
                    if isinstance(item, JobEnded):
                        ended.append(item.job["id"])
                        got_first.set()
                    elif isinstance(item, Waited):
                        return item
            return None

        waiting = asyncio.create_task(wait())
        await asyncio.wait_for(got_first.wait(), 10)
        assert ended == [first]  # told at once, while the other is still queued
        assert not waiting.done()
        lease = await pool.queue.claim("stand-in", ["default"])
        assert lease is not None
        await pool.queue.complete(lease, Outcome(JobState.FAILED, exit_code=3))
        waited = await asyncio.wait_for(waiting, 10)
    assert ended == [first, second]
    assert waited is not None
    assert [j["state"] for j in waited.jobs] == ["cancelled", "failed"]


async def test_top_and_ls_watch_piped_print_each_view(pool: Pool) -> None:
    env = pool.env("alice")
    for queue in ("default", "default", "big"):
        await poolctl(env, "enqueue", "-q", queue, "--", "true")
    code, out, err = await poolctl(env, "top", "-n", "2", "-d", "0.5")
    assert code == 0, err
    views = out.strip().split("\n\ngpupool at ")
    assert len(views) == 2
    for view in views:
        assert "0 worker(s), 0 healthy; slots 0/0 busy; GPUs 0/0 busy; 3 queued, 0 running" in view
        lines = view.split("\n")
        queues = lines[lines.index("QUEUES") + 2 : lines.index("QUEUES") + 4]
        assert [q.split()[:3] for q in queues] == [["big", "1", "0"], ["default", "2", "0"]]
        assert "no workers" not in view  # an empty table under its title, not a sentence

    code, out, err = await poolctl(env, "ls", "--watch", "0.5", "-n", "3", "--format", "queue,state")
    assert code == 0, err
    assert out.count("3 job(s) at ") == 3
    assert out.count("default  queued") == 6

    code, out, _ = await poolctl(env, "top", "-n", "2", "-d", "0.5", "--json")
    assert code == 0
    views_json = [orjson.loads(line) for line in out.splitlines()]
    assert [(len(v["jobs"]), v["workers"]) for v in views_json] == [(3, []), (3, [])]


async def test_bad_intervals_are_refused_with_a_sentence(pool: Pool) -> None:
    env = pool.env("alice")
    for args, says in (
        (("ls", "--watch", "0"), "--watch/-w: expected a positive number of seconds, not '0'"),
        (("top", "-d", "-1"), "-d/--delay: expected a positive number of seconds, not '-1'"),
        (("top", "-n", "-2"), "-n/--views: expected a whole number from 0 to 1000000, not '-2'"),
    ):
        code, _, err = await poolctl(env, *args)
        assert code == 2, args
        assert says in err


async def test_wait_on_many_jobs_prints_each_as_it_ends(pool: Pool) -> None:
    env = pool.env("alice")
    async with pool.client() as c:
        ids = (await c.call(EnqueueBatch([{"argv": ["true"]}] * 3), EnqueuedBatch)).job_ids
        await c.call(CancelJobs(ids[:2]), Cancelled)
    code, out, err = await poolctl(env, "wait", "--timeout", "1", *ids)
    assert code == 124
    assert "timed out after 1 s" in err
    assert out.splitlines() == [f"{ids[0]}\tcancelled", f"{ids[1]}\tcancelled", f"{ids[2]}\tqueued"]


async def test_top_on_a_terminal_draws_the_pool_and_no_sequence_of_a_jobs_own(pool: Pool) -> None:
    await hostile_job(pool)
    assert await pool.queue.claim("stand-in", ["default"]) is not None  # running: its name is shown
    out = await in_a_terminal(pool.env("alice"), "top", "-n", "1")
    assert "QUEUES" in out
    assert "\\x1b]0;pwned" in out  # the name, its escape shown as text
    assert "RUNNING" in out
    assert "\x1b[?1049h" in out  # the whole screen, given back at the end (as top does)
    assert "\x1b]0;" not in out  # the job's own sequences are not in it: no title set
    assert HOSTILE not in out


async def test_top_runs_until_ctrl_c_and_exits_130_without_a_traceback(pool: Pool) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "daemon.ctl.cli", "top", "-d", "0.5",
        env={**pool.env("alice"), "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        first = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert first.startswith(b"gpupool at ")
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 130
    assert b"Traceback" not in err


async def test_wait_and_cancel_speak_json_a_line_each(pool: Pool) -> None:
    env = pool.env("alice")
    async with pool.client() as c:
        ids = (await c.call(EnqueueBatch([{"argv": ["true"]}] * 2), EnqueuedBatch)).job_ids
    code, out, _ = await poolctl(env, "cancel", "--json", *ids)
    assert code == 0
    assert [orjson.loads(line) for line in out.splitlines()] == [{"id": i, "state": "cancelled"} for i in ids]
    code, out, _ = await poolctl(env, "wait", "--json", *ids)
    assert code == 1  # cancelled is not succeeded
    records = [orjson.loads(line) for line in out.splitlines()]
    assert sorted(r["id"] for r in records) == sorted(ids)
    assert {r["state"] for r in records} == {"cancelled"}


async def test_busy_slots_are_the_running_jobs_and_a_silent_worker_is_late(
    pool: Pool, redis_server: EmbeddedRedis, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 47 item 7. `top` counted busy slots from each worker's last heartbeat, up to a period
    old, beside the running jobs the queue knows (`slots 0/2 busy ... 1 running`): both now come
    from the queue. And a worker whose heartbeats stopped (a real poold, SIGSTOPped) was shown
    healthy until its healthy period ran out: it is late once it has missed its beats."""
    from tests.support.workers import running_worker, sh, wait_file

    env = pool.env("alice")
    await pool.queue.enqueue(sh("echo started > started; sleep 30", cwd=str(tmp_path), user="alice"))
    # a heartbeat every 30 s: the one before the job started is the last the view could have seen
    async with running_worker(pool.queue, tmp_path / "w", slots=2, heartbeat_seconds=30.0):
        await wait_file(tmp_path / "started")
        code, out, err = await poolctl(env, "top", "-n", "1")
        assert code == 0, err
        assert "1 worker(s), 1 healthy; slots 1/2 busy; GPUs 0/0 busy; 0 queued, 1 running" in out

        period, beat = 60.0, 0.2  # late after 0.5 s of silence, dead after 60 s
        with _worker_process(redis_server, tmp_path / "frozen", s3_env, period, beat) as frozen:
            for _ in range(200):  # a bound, not a speed assertion: until it has registered
                if len(await list_workers(pool.queue.redis)) == 2:
                    break
                await asyncio.sleep(0.05)
            frozen.send_signal(signal.SIGSTOP)
            await asyncio.sleep(3 * beat)
            code, out, err = await poolctl(env, "workers")
            assert code == 0, err
            states = {line.split()[0]: line.split()[2] for line in out.splitlines()[1:]}
            assert sorted(states.values()) == ["healthy", "late"], out
            code, out, _ = await poolctl(env, "health")
            assert "1 healthy worker(s)" in out


@contextmanager
def _worker_process(
    redis_server: EmbeddedRedis, data_dir: Path, s3_env: dict[str, str], period: float, beat: float
) -> Iterator[subprocess.Popen[bytes]]:
    """A worker `poold` of the pool on `redis_server`, heartbeating every `beat` seconds."""
    env = dict(os.environ, GPUPOOL_MAIN_SERVER_REDIS_PASSWORD=redis_server.password, **s3_env, **JOBS_AS_ROOT)
    argv = [sys.executable, "-m", "daemon.main", "--worker", "--worker-mode", "multinode"]
    argv += ["--redis-port", str(redis_server.port), "--metrics-listen", "127.0.0.1:0"]
    argv += ["--worker-healthy-response-period", str(period), "--heartbeat-interval", str(beat)]
    argv += ["--data-dir", str(data_dir), "--drain-timeout", "0", "--log-level", "warning"]
    with subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL) as proc:
        try:
            yield proc
        finally:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
