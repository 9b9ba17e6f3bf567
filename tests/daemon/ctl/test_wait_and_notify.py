"""`poolctl wait` on many jobs prints each as it ends, not all at the end; `poolctl enqueue --notify`
takes an http(s) URL and refuses anything else with a sentence. A real server, poolctl as a
subprocess (stdout a pipe: plain lines, no bar)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import orjson

from daemon.job import JobState, Outcome
from protocol import CancelJobs, Cancelled, EnqueueBatch, EnqueuedBatch
from tests.support.paths import ROOT
from tests.support.pool import Pool
from tests.support.poolctl import poolctl
from tests.support.workers import running_worker


async def test_wait_on_three_jobs_prints_a_line_as_each_ends(pool: Pool) -> None:
    async with pool.client() as c:
        ids = (await c.call(EnqueueBatch([{"argv": ["true"]}] * 3), EnqueuedBatch)).job_ids
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "daemon.ctl.cli", "wait", "--timeout", "60", *ids,
        env={**pool.env("alice"), "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    try:
        for job_id, state, code in zip(
            ids, (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED), (0, 3, None), strict=True
        ):
            if state is JobState.CANCELLED:
                async with pool.client() as c:
                    await c.call(CancelJobs([job_id]), Cancelled)
            else:
                lease = await pool.queue.claim("stand-in", ["default"])
                assert lease is not None
                assert lease.job_id == job_id
                await pool.queue.complete(lease, Outcome(state, exit_code=code))
            # Printed now, while the jobs after it are still queued: not kept for the end.
            lines.append((await asyncio.wait_for(proc.stdout.readline(), 15)).decode())
        out, err = await asyncio.wait_for(proc.communicate(), 15)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert lines == [
        f"{ids[0]}\tsucceeded\texit 0\n",
        f"{ids[1]}\tfailed\texit 3\n",
        f"{ids[2]}\tcancelled\n",
    ]
    assert out == b""  # each job once
    assert b"Traceback" not in err
    assert proc.returncode == 1  # not all succeeded


async def test_enqueue_notify_takes_an_http_url_and_refuses_another_with_a_sentence(pool: Pool) -> None:
    env = pool.env("alice")
    code, out, err = await poolctl(env, "enqueue", "--notify", "ftp://hooks.example.com/x", "--", "true")
    assert code == 2
    assert err == (
        "poolctl: --notify 'ftp://hooks.example.com/x': expected an http:// or https:// URL with a host, "
        "e.g. https://hooks.example.com/gpupool\n"
    )
    assert out == ""
    url = "https://hooks.example.com/gpupool?token=abc"
    code, out, err = await poolctl(env, "enqueue", "--notify", url, "--", "true")
    assert code == 0, err
    code, shown, _ = await poolctl(env, "show", "--json", out.strip())
    assert code == 0
    assert orjson.loads(shown)["spec"]["notify"] == url
    code, out, err = await poolctl(env, "enqueue", "--", "true")  # none given: none sent
    assert code == 0, err
    _, shown, _ = await poolctl(env, "show", "--json", out.strip())
    assert "notify" not in orjson.loads(shown)["spec"]


async def test_wait_says_why_a_job_failed_when_its_exit_code_does_not(pool: Pool, tmp_path: Path) -> None:
    """issue 43 item 8: a timed-out job was reported only as `failed  exit 143`."""
    env = pool.env("alice")
    code, job_id, err = await poolctl(env, "enqueue", "--timeout", "0.5", "--", "sleep", "30")
    assert code == 0, err
    async with running_worker(pool.queue, tmp_path / "w"):
        code, out, err = await poolctl(env, "wait", job_id.strip(), "--timeout", "30")
    assert code == 1, err
    assert (
        out == f"{job_id.strip()}\tfailed\texit 143\ttimed out after 0.5 s; killed by signal 15 (SIGTERM)\n"
    )
