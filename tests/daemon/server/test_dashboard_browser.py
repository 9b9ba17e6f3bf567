"""The dashboard in a real headless browser (chromium), against a real pool: a server on the
test's Redis, a real worker running real processes, two users with tokens.

What a user does and sees, each without a reload by the test: sign in with a pool token; a running
job's log line appears live; cancelling your own job turns it cancelled; another user's job has no
cancel button for you; no session, no page; a foreign Host (a DNS-rebinding site, played with
chromium's own resolver rules) is refused. A screenshot of each page is saved as a test artefact
(test-artefacts/screenshots/).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from daemon.job import JobState
from daemon.metrics.worker import GpuSample
from daemon.queue.embedded_redis import EmbeddedRedis
from tests.support.browser import Browser, browser
from tests.support.pool import Pool, running_pool
from tests.support.workers import fake_gpus, running_worker, sh, wait_state

pytestmark = pytest.mark.timeout(120)


async def sign_in(b: Browser, pool: Pool, user: str, path: str = "/") -> None:
    assert pool.server.web is not None
    await b.get(pool.server.web.address + path)
    assert "/signin" in await b.url()
    await b.fill("#token", pool.tokens[user])
    await b.click("#signin")
    await b.wait_text("#me", user)


def readings() -> list[GpuSample]:
    """What NVML would say of the two made-up GPUs: GPU 0 busy by turns, GPU 1 steady at 75 %."""
    wave = math.sin(time.time() * 3)
    return [
        GpuSample("GPU-00000000-fake", 0.45 + 0.4 * wave, int((5 + 2 * wave) * 2**30), 16 * 2**30),
        GpuSample("GPU-00000001-fake", 0.75, 4 * 2**30, 16 * 2**30),
    ]


async def test_sign_in_see_a_log_line_appear_live_and_cancel_your_own_job(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    async with (
        running_pool(redis_server, tmp_path) as pool,
        running_worker(
            pool.queue,
            tmp_path / "w",
            slots=2,
            gpus=fake_gpus(2),
            gpu_sampler=readings,
            heartbeat_seconds=0.3,
        ),
        browser() as b,
    ):
        job_id, _ = await pool.queue.enqueue(
            sh(
                f"echo first line; while [ ! -e {go} ]; do sleep 0.05; done; echo second line; sleep 60",
                user="alice",
            )
        )
        await wait_state(pool.queue, job_id, JobState.RUNNING)
        for n in range(3):  # bob's jobs: one runs beside alice's, two wait
            await pool.queue.enqueue(sh("sleep 60", user="bob", name=f"sweep-{n}"))
        await sign_in(b, pool, "alice", f"/jobs/{job_id}")
        assert job_id in await b.text("#job-id")
        await b.wait_text("#log", "first line")
        go.touch()  # the job prints its second line only now: the page must show it by itself
        await b.wait_text("#log", "second line")
        await b.screenshot("job")
        await b.click("#cancel")
        await b.wait_text("#job-state", "cancelled")
        await b.wait_text("#log-state", "the log ended: cancelled")
        assert (await pool.queue.get(job_id)).state is JobState.CANCELLED

        await b.get(pool.server.web.address + "/")  # type: ignore[union-attr]
        await b.wait_text("#queues", "default")
        await b.wait_text("#workers", "GPU 1")
        await b.wait_text("#workers", "75 %")  # GPU 1's utilisation, from the worker's heartbeats
        await b.wait_exists("#workers svg polyline")  # its recent readings drawn, as they come
        await b.screenshot("pool")
        await b.click("#workers a")
        await b.wait_text("#worker-id", "")
        assert "Fake GPU" in await b.page_text()
        await b.screenshot("worker")
        await b.get(pool.server.web.address + "/jobs?user=alice")  # type: ignore[union-attr]
        await b.wait_text("#jobs-table", job_id)
        await b.screenshot("jobs")


async def test_another_users_job_shows_no_cancel_and_hides_what_is_theirs(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    async with (
        running_pool(redis_server, tmp_path) as pool,
        running_worker(pool.queue, tmp_path / "w", slots=1),
        browser() as b,
    ):
        job_id, _ = await pool.queue.enqueue(
            sh("printf 'alice%s\\n' ' was here'; sleep 60", user="alice", env={"WANDB_API_KEY": "s3cret"})
        )
        await wait_state(pool.queue, job_id, JobState.RUNNING)
        await sign_in(b, pool, "bob", f"/jobs/{job_id}")
        await b.wait_text("#job-state", "running")
        page = await b.page_text()
        assert not await b.exists("#cancel")
        assert "s3cret" not in page
        assert "WANDB_API_KEY" in page
        assert "Only the job's owner or a pool admin may read its log" in page
        assert "alice was here" not in page

        # The form the page does not offer, sent anyway with bob's own session and CSRF token.
        forge = """
            const f = document.createElement('form');
            f.method = 'post';
            f.action = '/jobs/' + arguments[0] + '/cancel';
            const c = document.createElement('input');
            c.name = 'csrf';
            c.value = document.querySelector('input[name=csrf]').value;
            f.appendChild(c);
            document.body.appendChild(f);
            f.submit();
        """
        await b.call(b.driver.execute_script, forge, job_id)
        await b.wait_text("#error", "belongs to alice: only its owner or a pool admin may cancel it")
        await b.screenshot("refused")
        assert (await pool.queue.get(job_id)).state is JobState.RUNNING


async def test_no_session_no_page_and_a_foreign_host_is_refused(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    async with running_pool(redis_server, tmp_path) as pool:
        assert pool.server.web is not None
        port = pool.server.web.port
        async with browser(host_rules="MAP rebound.example 127.0.0.1") as b:
            await b.get(f"http://127.0.0.1:{port}/jobs")
            assert (await b.url()).endswith("/signin?next=/jobs")
            assert await b.exists("#token")
            await b.screenshot("signin")
            await b.fill("#token", "not-a-token")
            await b.click("#signin")
            await b.wait_text("#signin-failed", "not one this pool knows")

            # A site whose name now points here (DNS rebinding) gets nothing, signed in or not.
            await sign_in(b, pool, "alice")
            await b.get(f"http://rebound.example:{port}/")
            assert "does not answer for the host 'rebound.example" in await b.page_text()
            assert not await b.exists("#queues")
