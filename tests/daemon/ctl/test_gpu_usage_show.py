"""Issue 50: what a job's GPUs did, where a user looks. A real pool server, a real worker on a
made-up GPU whose readings the test sets (the sampler seam), `poolctl` as a subprocess and the
dashboard over HTTP: `show` has a "gpu usage" line and an idle flag's line, `--json` the record's
`gpu_usage` and `idle_gpu`, the job's page a small figure of them under its strict CSP."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from daemon.job import JobState
from daemon.metrics.worker import GpuSample
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.worker.idle_gpus import IdlePolicy
from tests.daemon.server.test_dashboard_http import assert_no_inline_code_or_foreign_urls, client, sign_in
from tests.support.pool import running_pool
from tests.support.poolctl import poolctl
from tests.support.workers import fake_gpus, running_worker, sh, wait_state

pytestmark = pytest.mark.timeout(60)

GIB = 2**30


async def test_show_json_and_the_job_page_say_what_its_gpu_did_and_that_it_sat_idle_gpu(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """Issue 50, per-job GPU usage and idle GPUs, shown: a job whose GPU reads 2 % is flagged
    idle after the (shortened) idle_gpu_minutes and ends by itself; `poolctl show` gives its usage
    (2 % mean and p95, its 3 GiB peak, efficiency 2 %) and the flag in a line each, `show --json`
    the record's fields, and its dashboard page both, the usage as an SVG bar and mark."""
    gpus = fake_gpus(1)

    def sampler() -> list[GpuSample]:
        return [GpuSample(gpus[0].uuid, 0.02, 3 * GIB, 16 * GIB, power_w=50.0)]

    policy = IdlePolicy(util=5, minutes=0.2 / 60)
    async with (
        running_pool(redis_server, tmp_path) as pool,
        running_worker(
            pool.queue,
            tmp_path / "w",
            slots=1,
            gpus=gpus,
            gpu_sampler=sampler,
            heartbeat_seconds=0.05,
            idle_gpus=policy,
        ),
    ):
        job_id, _ = await pool.queue.enqueue(sh("sleep 0.6", gpus=1, user="alice"))
        info = await wait_state(pool.queue, job_id, JobState.SUCCEEDED, timeout=15)
        assert info.idle_gpu is not None  # flagged before its end (the end is recorded after the flag)
        env = pool.env("alice")
        code, out, err = await poolctl(env, "show", job_id)
        assert code == 0, err
        lines = {
            line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in out.splitlines() if ":" in line
        }
        assert lines["gpu usage"].startswith("2 % mean, 2 % p95, peak 3 GiB, ")
        assert "efficiency 2 %" in lines["gpu usage"]
        assert lines["gpu idle"].startswith("below 5 % for ")
        assert lines["gpu idle"].endswith("(attempt 1)")
        code, out, err = await poolctl(env, "show", "--json", job_id)
        assert code == 0, err
        record = orjson.loads(out)
        assert record["gpu_usage"]["util_mean"] == 2.0
        assert record["gpu_usage"]["gpus"][0]["uuid"] == gpus[0].uuid
        assert record["idle_gpu"]["action"] is None
        assert pool.server.web is not None
        async with client() as http:
            await sign_in(http, pool, "alice")
            async with http.get(f"{pool.server.web.address}/jobs/{job_id}") as r:
                assert r.status == 200
                page = await r.text()
        assert_no_inline_code_or_foreign_urls(f"/jobs/{job_id}", page)
        assert 'id="gpu-usage"' in page
        assert "2 % mean, 2 % p95, peak 3.0 GiB" in page
        assert 'id="idle-gpu"' in page
        assert '<rect class="fill" x="0" y="9" width="2.4" height="10"/>' in page  # 2 % of 120
