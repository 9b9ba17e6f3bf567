"""Arrays and sweeps (`poolctl enqueue --array 0-99%8`, `--sweep k=v1,v2`, daemon/ctl/arrays.py):
reading them, the specs they make, and end to end with a real server, worker and processes: an
array of 100 with %8 never runs more than 8 at once; a sweep's jobs see their values; cancel,
wait and show take the array's id."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from daemon.ctl.arrays import ArrayError, array_specs, parse_array, parse_sweep
from daemon.job import JobState
from daemon.queue.embedded_redis import EmbeddedRedis
from tests.support.faults import memory_full
from tests.support.pool import running_pool
from tests.support.poolctl import poolctl
from tests.support.workers import logs_its_span, most_at_once, running_worker, wait_until


def test_indices_and_the_limit_are_read_as_slurm_writes_them() -> None:
    assert parse_array("0-3") == ([0, 1, 2, 3], 0)
    assert parse_array("1,3,5-7%2") == ([1, 3, 5, 6, 7], 2)
    for bad in ("", "a-b", "3-1", "0-9%0", "0-9%x", "1,1", "0-20000"):
        with pytest.raises(ArrayError, match="--array"):
            parse_array(bad)
    # issue 47 item 9: a %N or an index msgpack cannot pack (a traceback once sent), and a range
    # refused only once it was made, a list of a billion (a hang)
    for bad in ("0-3%" + "9" * 20, "9" * 20, "0-1000000000"):
        with pytest.raises(ArrayError, match="--array"):
            parse_array(bad)


def test_a_sweep_is_the_cartesian_product_and_fills_the_command() -> None:
    points = parse_sweep(["lr=1e-3,3e-4", "bs=32,64"])
    assert points == [
        {"lr": "1e-3", "bs": "32"},
        {"lr": "1e-3", "bs": "64"},
        {"lr": "3e-4", "bs": "32"},
        {"lr": "3e-4", "bs": "64"},
    ]
    array_id, specs = array_specs({"argv": ["train", "--lr={lr}", "{bs}"], "queue": "q"}, None, points, 0)
    assert array_id.startswith("q@")
    assert [s["argv"] for s in specs][1] == ["train", "--lr=1e-3", "64"]
    assert specs[1]["env"] == {"lr": "1e-3", "bs": "64"}
    assert [s["array_pos"] for s in specs] == [0, 1, 2, 3]
    for bad in (["lr"], ["1x=2"], ["lr=1", "lr=2"]):
        with pytest.raises(ArrayError, match="--sweep"):
            parse_sweep(bad)


async def test_an_array_of_100_with_a_limit_of_8_never_runs_more_than_8(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    log = tmp_path / "log"
    script = logs_its_span(log)
    async with running_pool(redis_server, tmp_path) as pool:
        env = pool.env("alice")
        code, out, err = await poolctl(env, "enqueue", "--array", "0-99%8", "--", "sh", "-c", script)
        assert code == 0, err
        array_id = out.strip()
        assert "100 jobs queued as array" in err
        async with running_worker(pool.queue, tmp_path / "w", slots=12):
            code, out, err = await poolctl(env, "wait", array_id, "--timeout", "120")
            assert code == 0, err
        code, out, _ = await poolctl(env, "show", array_id)
        assert "100: 100 succeeded" in out
    lines = log.read_text().splitlines()
    assert len(lines) == 200
    assert 1 < most_at_once(lines) <= 8


async def test_a_sweeps_jobs_see_their_values_and_the_array_id_cancels_them_all(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    async with running_pool(redis_server, tmp_path) as pool:
        env = pool.env("alice")
        code, out, err = await poolctl(
            env, "enqueue", "--json", "--sweep", "lr=1e-3,3e-4", "--sweep", "bs=32,64", "--",
            "sh", "-c", "echo {lr} {bs} $lr $bs $GPUPOOL_ARRAY_INDEX",
        )  # fmt: skip
        assert code == 0, err
        made = json.loads(out)
        assert len(made["jobs"]) == 4
        async with running_worker(pool.queue, tmp_path / "w", slots=2):
            code, _, err = await poolctl(env, "wait", made["array"], "--timeout", "60")
            assert code == 0, err
        said = [
            b"".join(d for _, d in await pool.queue.read_log(job_id)).decode().strip()
            for job_id in made["jobs"]
        ]
        assert said == ["1e-3 32 1e-3 32 0", "1e-3 64 1e-3 64 0", "3e-4 32 3e-4 32 0", "3e-4 64 3e-4 64 0"]
        code, out, err = await poolctl(
            env, "ls", "--all", "--array", made["array"], "--format", "id", "--no-header"
        )
        assert (code, sorted(out.split())) == (0, sorted(made["jobs"])), err
        code, out, err = await poolctl(env, "get", made["array"], str(tmp_path / "got"))  # each job's
        assert code == 0, err
        assert sorted(line.split()[2] for line in err.splitlines()) == sorted(made["jobs"])
        assert err.count("has no artifacts") == 4  # (this pool keeps none: no object store runs)
        code, out, err = await poolctl(env, "enqueue", "--array", "0-9%2", "--", "sleep", "30")
        assert code == 0, err
        code, out, err = await poolctl(env, "cancel", out.strip())
        assert code == 0, err
        assert out.count("cancelled") == 10

        async def all_cancelled() -> bool:
            jobs = await pool.queue.list_jobs(include_finished=True)
            return all(j.state is JobState.CANCELLED for j in jobs if j.spec.argv == ("sleep", "30"))

        await wait_until(all_cancelled, what="the array's jobs to be cancelled")


async def test_an_array_that_waits_for_a_job_keeps_its_limit(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 43 item 3: `--array 0-9%2 --after X` (preprocess, then a throttled array) runs at
    most 2 of the array at once once X has succeeded; and the window is a count of the array's
    jobs under way, as Slurm's %N is: a long first job does not narrow it to one."""
    log = tmp_path / "log"
    script = logs_its_span(log, 0.1)
    async with running_pool(redis_server, tmp_path) as pool:
        env = pool.env("alice")
        code, first, err = await poolctl(env, "enqueue", "--", "sleep", "0.2")
        assert code == 0, err
        code, out, err = await poolctl(
            env, "enqueue", "--array", "0-9%2", "--after", first.strip(), "--", "sh", "-c", script
        )
        assert code == 0, err
        code, long, err = await poolctl(
            env, "enqueue", "--array", "0-5%2", "--", "sh", "-c", "[ $GPUPOOL_ARRAY_INDEX != 0 ] || sleep 3"
        )
        assert code == 0, err
        async with running_worker(pool.queue, tmp_path / "w", slots=12):
            code, _, err = await poolctl(env, "wait", out.strip(), "--timeout", "60")
            assert code == 0, err
            code, _, err = await poolctl(env, "wait", long.strip(), "--timeout", "60")
            assert code == 0, err
        listed = await pool.queue.list_jobs(include_finished=True)
    jobs = {j.spec.array_index: j for j in listed if j.spec.array == long.strip()}
    throttled = sorted((j for j in listed if j.spec.array == out.strip()), key=lambda j: j.spec.array_index)
    lines = log.read_text().splitlines()
    assert len(lines) == 20
    assert most_at_once(lines) == 2
    starts = [j.started_at or 0 for j in throttled]  # claimed (Redis's clock) by index: let in so
    assert starts == sorted(starts)
    first_end = jobs[0].ended_at
    assert first_end is not None
    assert all((jobs[i].ended_at or 0) < first_end for i in range(1, 6))  # all passed the long one


async def test_an_array_whose_batch_failed_midway_is_named_for_its_cancel(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 43 item 1: an array's batch that fails once sent (here its Redis is full, which the
    server's last reading of its memory did not show; a server SIGKILLed under it is the same
    for poolctl) may have queued some of its jobs: poolctl says the array's id, and that
    `cancel` takes it."""
    async with running_pool(redis_server, tmp_path) as pool:
        code, _, err = await poolctl(pool.env("alice"), "enqueue", "--", "true")  # Redis read: room
        assert code == 0, err
        assert pool.server.listener is not None
        pool.server.listener.handlers.admission.room.every = 3600.0  # and not read again
        async with memory_full(redis_server):
            code, out, err = await poolctl(pool.env("alice"), "enqueue", "--array", "0-9%2", "--", "true")
        assert code == 1, err
        assert out == ""
        said = re.search(r"array (default@[0-9a-f]+) may be partly queued: .*'poolctl cancel \1'", err)
        assert said is not None, err
        assert "the pool's Redis is full (maxmemory reached)" in err


async def test_an_array_refused_whole_by_a_bound_is_not_said_partly_queued(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 44 item 6: the server refuses an array before writing any of it when its Redis is
    nearly full or its user is over a bound, but poolctl took that refusal (UNAVAILABLE) for a
    batch failed midway and said the array "may be partly queued". Such a refusal has its own
    code (RESOURCE_EXHAUSTED), and poolctl says nothing was queued."""
    async with running_pool(redis_server, tmp_path, user_max_queued_jobs=5) as pool:
        code, _, err = await poolctl(pool.env("alice"), "enqueue", "--array", "0-9", "--", "true")
        assert code == 1, err
        assert "nothing of this submission was queued" in err
        assert "user_max_queued_jobs" in err
        assert "partly queued" not in err
        assert pool.server.listener is not None
        pool.server.listener.handlers.admission.room.every = 0.0  # Redis's memory read at each submission
        async with memory_full(redis_server):
            code, _, err = await poolctl(pool.env("alice"), "enqueue", "--array", "0-1", "--", "true")
        assert code == 1, err
        assert "the pool's Redis is full, or nearly" in err
        assert "nothing of this submission was queued" in err
        assert "partly queued" not in err
        assert await pool.queue.list_jobs(include_finished=True) == []
