"""The peer of bench/env_start.py: Ray Jobs running the same locked project with `working_dir`
and uv (`uv run --frozen`, Ray's way to a uv.lock), cold and warm, submit -> the job's first line.

Run with a Python that has `ray[default]` (it is no dependency of gpupool's, not even the bench
extra: it pins its own world), from env_start.py:
`python -m bench.env_start --ray-python /path/to/venv/bin/python`. It starts a one-node Ray
cluster on loopback and stops it at the end; prints one JSON object.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ray.job_submission import JobStatus, JobSubmissionClient

ADDRESS = "http://127.0.0.1:8265"


def first_line(client: JobSubmissionClient, project: Path, uv: str, cache: Path, imports: str) -> float:
    """Seconds from submit to the job's line READY (its logs read every 20 ms)."""
    started = time.perf_counter()
    job = client.submit_job(
        entrypoint=f"{uv} run --frozen python -c \"import {imports}; print('READY')\"",
        runtime_env={
            "working_dir": str(project),
            "env_vars": {"UV_CACHE_DIR": str(cache), "SSL_CERT_FILE": os.environ.get("SSL_CERT_FILE", "")},
        },
    )
    while "READY" not in client.get_job_logs(job).splitlines():
        if client.get_job_status(job) in {JobStatus.FAILED, JobStatus.STOPPED}:
            raise RuntimeError(client.get_job_logs(job)[-2000:])
        time.sleep(0.02)
    took = time.perf_counter() - started
    while client.get_job_status(job) not in {JobStatus.SUCCEEDED, JobStatus.FAILED}:
        time.sleep(0.05)
    return took


def main() -> None:
    project, uv, imports, runs = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    ray = str(Path(sys.executable).parent / "ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run(
        [ray, "start", "--head", "--num-cpus=2", "--disable-usage-stats", "--dashboard-host=127.0.0.1"],
        env=env,
        check=True,
        capture_output=True,
    )
    base = Path(tempfile.mkdtemp(prefix="gpupool-bench-ray-"))
    try:
        client = JobSubmissionClient(ADDRESS)
        cold, warm = [], []
        for n in range(runs):
            # empty caches: a uv cache of its own, and a working_dir Ray has not seen (a file
            # more), so neither its package nor the .venv uv makes in it is found again
            copy = base / f"project-{n}"
            shutil.copytree(project, copy)
            (copy / "run.txt").write_text(str(n))
            cold.append(first_line(client, copy, uv, base / f"uv-cache-{n}", imports))
            warm.append(first_line(client, copy, uv, base / f"uv-cache-{n}", imports))
        print(json.dumps({"cold": sorted(cold), "warm": sorted(warm)}))
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, check=False, capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
