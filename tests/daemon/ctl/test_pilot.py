"""`poolctl pilot`: workers as batch jobs. The scripts it writes (for PBS, whose server no Debian
package provides, the directives qsub must find), its refusals, and a real run on a one-node Slurm
cluster on loopback (tests/support/slurm.py): an unprivileged cluster user submits two pilots,
which join a running pool, run its jobs of the pool user they serve, pass over another user's
job, one whose time limit would outlive them and one with none, keep their credentials from their
jobs and their node-local trees from everyone, and at their lifetime's end drain and end their
batch jobs with exit 0; and a PBS pilot submitted through a real qsub, Debian's slurm-wlm-torque
over that Slurm, joins, runs a job and leaves."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.job import JobState
from daemon.queue import registry
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.worker.hosted import hosted_worker
from protocol import CancelJobs, Cancelled
from tests.support import unprivileged
from tests.support.pool import Pool, running_pool
from tests.support.poolctl import poolctl
from tests.support.slurm import SlurmCluster, missing
from tests.support.workers import JOBS_AS_ROOT, sh, wait_state, wait_until


def pilot_config(path: Path, pool: Pool, user: str, owner: str | None = None, **extra: object) -> Path:
    """An agent's pool.toml, mode 600: the pool's server and `user`'s token (in a file beside it,
    mode 600), no Redis or S3 credential; both files `owner`'s (a cluster user), else root's."""
    token = path.with_name(f"{path.stem}.token")
    token.write_text(pool.tokens[user] + "\n")
    values: dict[str, object] = {
        "worker_via_server": pool.address,
        "worker_token_file": str(token),
        "metrics_listen": "127.0.0.1:0",  # two pilots on one node
        **{k.removeprefix("GPUPOOL_").lower(): v for k, v in JOBS_AS_ROOT.items()},
        **extra,
    }
    path.write_text("".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in values.items()))
    for made in (token, path):
        made.chmod(0o600)
        if owner is not None:
            os.chown(made, pwd.getpwnam(owner).pw_uid, pwd.getpwnam(owner).pw_gid)
    return path


@contextlib.asynccontextmanager
async def s3_pool(redis_server: EmbeddedRedis, s3_env: dict[str, str], tmp: Path) -> AsyncIterator[Pool]:
    """A running pool on S3 whose server runs a worker for each agent, as poold's does."""
    tmp.mkdir()
    s3: dict[str, Any] = {k.removeprefix("GPUPOOL_").lower(): v for k, v in s3_env.items()}
    async with running_pool(redis_server, tmp, agent_workers=hosted_worker, **s3) as pool:
        yield pool


def plain_config(path: Path, mode: int = 0o600, **extra: object) -> Path:
    """An agent's pool.toml for a pool whose server is at 10.1.2.3: its user's token file beside it."""
    token = path.with_name("token")
    token.write_text("not-a-real-token\n")
    token.chmod(0o600)
    lines = ['worker_via_server = "10.1.2.3:7000"', f'worker_token_file = "{token}"']
    path.write_text("\n".join([*lines, *(f"{k} = {v}" for k, v in extra.items())]) + "\n")
    path.chmod(mode)
    return path


def env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", **extra}


async def test_the_slurm_script_carries_the_directives_and_the_worker(tmp_path: Path) -> None:
    config = plain_config(tmp_path / "pool.toml")
    code, out, err = await poolctl(
        env(GPUPOOL_REDIS_PORT="1", GPUPOOL_USER="alice"),
        "pilot", "slurm", "--count", "3", "--walltime", "1:00:00", "--gpus-per-node", "4",
        "--partition", "gpu", "--account", "proj7", "--config", str(config), "--dry-run",
    )  # fmt: skip
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert [line for line in lines if line.startswith("#SBATCH")] == [
        "#SBATCH --job-name=gpupool-pilot",
        "#SBATCH --time=1:00:00",
        "#SBATCH --nodes=1",
        "#SBATCH --gres=gpu:4",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj7",
        "#SBATCH --output=gpupool-pilot-%j.out",
    ]
    [exec_line] = [line for line in lines if line.startswith("exec ")]
    # 3600 s less a margin of 2% (72 s); the config given as an absolute path; the pool user that
    # poolctl acts as is the one the pilots serve (issue 44 item 1)
    assert f"--worker --config {config} --serve-user alice --max-lifetime 3528 --idle-exit 600" in exec_line
    # a node-local tree of its own, made by mktemp (mode 700, a name no one can plant first)
    assert 'data_dir=$(mktemp -d "${TMPDIR:-/tmp}/gpupool-pilot.XXXXXXXXXX") || exit 1' in lines
    assert exec_line.endswith('--data-dir "$data_dir"')
    assert 'unset "$v"' in out  # GPUPOOL_REDIS_PORT=1 of this shell does not reach the worker
    assert lines[-1] == "# submit: sbatch --parsable < this script, 3 times"


async def test_the_pbs_script_carries_what_qsub_must_read(tmp_path: Path) -> None:
    """No PBS server is packaged here: the directives are checked against what qsub (PBS Pro,
    OpenPBS) reads: -N name, -l walltime=HH:MM:SS, -l select=1:ngpus=G, -q queue, -A account,
    -j oe; the GPUs are asked of Slurm too, for Slurm's qsub (a comment to PBS); and the script
    runs the worker with a lifetime inside the walltime. Submitted for real through Slurm's qsub
    below."""
    config = plain_config(tmp_path / "pool.toml", drain_timeout=30)
    code, out, err = await poolctl(
        env(),
        "pilot", "pbs", "--walltime", "30:00:00", "--gpus-per-node", "2", "--queue", "gpuq",
        "--account", "proj7", "--idle-exit", "120", "--config", str(config), "--serve-user", "carol",
        "--dry-run",
    )  # fmt: skip
    assert code == 0, err
    assert "--serve-user carol --max-lifetime" in out
    directives = [line.removeprefix("#PBS ") for line in out.splitlines() if line.startswith("#PBS ")]
    assert directives == [
        "-N gpupool-pilot",
        "-l walltime=30:00:00",
        "-l select=1:ngpus=2",
        "-q gpuq",
        "-A proj7",
        "-j oe",
    ]
    assert "#SBATCH --gres=gpu:2" in out.splitlines()
    assert "--max-lifetime 107700 --idle-exit 120" in out  # 108000 s less 300 (the margin's cap)
    assert "$PBS_JOBID" in out
    assert out.splitlines()[-1] == "# submit: qsub -N gpupool-pilot -j oe FILE, this script saved as FILE"
    code, out, _ = await poolctl(
        env(), "pilot", "pbs", "--walltime", "0:10:00", "--gpus-per-node", "0", "--config", str(config),
        "--dry-run",
    )  # fmt: skip
    assert "#PBS -l select=1\n" in out
    assert "#SBATCH" not in out


@pytest.mark.parametrize(
    ("args", "mode", "code", "says"),
    [
        (("--walltime", "60"), 0o600, 2, "expected H:MM:SS"),
        (("--walltime", "0:00:50"), 0o600, 2, "would have 20 s to live"),
        (("--walltime", "1:00:00", "--max-lifetime", "4000"), 0o600, 2, "at most the walltime"),
        (("--walltime", "1:00:00"), 0o640, 4, "readable by others (mode 640)"),
        (("--walltime", "1:00:00", "--count", "0"), 0o600, 2, "--count: expected a whole number from 1"),
    ],
    ids=["bare-number", "too-short", "outlives", "readable", "count"],
)
async def test_a_pilot_that_cannot_be_is_refused_in_a_sentence(
    tmp_path: Path, args: tuple[str, ...], mode: int, code: int, says: str
) -> None:
    config = plain_config(tmp_path / "pool.toml", mode)
    got, out, err = await poolctl(env(), "pilot", "slurm", "--config", str(config), *args, "--dry-run")
    assert (got, out) == (code, "")
    assert says in err
    assert len(err.strip().splitlines()) == 1


async def test_a_config_that_is_not_an_agents_or_a_missing_sbatch_is_refused(tmp_path: Path) -> None:
    """issue 44 item 1: a pilot's jobs run as the cluster user, and read what it reads: its config.
    One holding the pool's Redis password or S3 keys is refused, as is one that is no agent's."""
    single = tmp_path / "single.toml"
    single.write_text("")
    single.chmod(0o600)
    code, _, err = await poolctl(env(), "pilot", "slurm", "--walltime", "1:00:00", "--config", str(single))
    assert code == 2
    assert "a pilot is an agent of the pool server, holding its user's token and no Redis or S3" in err
    assert len(err.strip().splitlines()) == 1
    keys = plain_config(tmp_path / "keys.toml", main_server_redis_password='"hunter2"')
    keys.write_text(keys.read_text() + 'main_server_minio_secret_access_key = "s3cret"\n')
    code, _, err = await poolctl(env(), "pilot", "slurm", "--walltime", "1:00:00", "--config", str(keys))
    assert code == 2
    assert "holds main_server_redis_password, main_server_minio_secret_access_key: a pilot's jobs" in err
    assert "hunter2" not in err
    config = plain_config(tmp_path / "pool.toml")
    code, _, err = await poolctl(
        env(PATH=str(tmp_path)), "pilot", "slurm", "--walltime", "1:00:00", "--config", str(config)
    )
    assert code == 2
    assert err.strip() == (
        "poolctl: sbatch not found: run poolctl pilot slurm on a login node of the cluster, where "
        "sbatch is on PATH (--dry-run prints the script)"
    )


@pytest.fixture
def slurm() -> Iterator[SlurmCluster]:
    if (why := missing()) is not None:
        pytest.skip(why)
    cluster = SlurmCluster()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_user() -> Iterator[tuple[str, Path]]:
    """A login user of the cluster, no admin (Slurm needs its passwd entry), and a directory of its
    own under the system's /tmp (pytest's is root's, closed to others); both removed after."""
    name = f"gpupilot{os.getpid() % 100_000}"
    add = ["useradd", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/bin/sh", "--user-group"]
    done = subprocess.run([*add, name], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot add a cluster user here: {done.stderr.strip()}")
    home = Path(tempfile.mkdtemp(prefix="gpupool-pilot-user-"))
    try:
        user = pwd.getpwnam(name)
        os.chown(home, user.pw_uid, user.pw_gid)
        with unprivileged.reachable():
            yield name, home
    finally:
        shutil.rmtree(home, ignore_errors=True)
        subprocess.run(["userdel", name], capture_output=True, timeout=30, check=False)


LIFETIME = 20  # seconds: the drain (4 s), the kill grace (2 s) and the hand-back fit, with jobs first


@pytest.mark.timeout(90)
async def test_pilots_of_a_cluster_user_serve_their_pool_user_only_keep_secrets_and_end_well(
    cluster_user: tuple[str, Path],  # first: removed after Slurm has ended its jobs
    redis_server: EmbeddedRedis,
    s3_env: dict[str, str],
    tmp_path: Path,
    slurm: SlurmCluster,
) -> None:
    """Two pilots submitted by an unprivileged cluster user, as `poolctl pilot` runs them, acting
    as pool user alice: they run alice's jobs, pass over one whose time limit would outlive them and
    one with none (issue 43 item 5), drain and end well. Issue 44 item 1: they are agents of the
    pool server, holding alice's token and no pool credential; bob's job, queued before alice's,
    is never run by them, and does not hold alice's back; a job there (of the cluster user's uid)
    reads the pilot's config and its token, finds no Redis password or S3 key in any, and with
    that token can act as alice only (bob's job is not hers to cancel); it cannot read the
    pilot's /proc environ nor open its descriptors. Item 3: each pilot's node-local tree is made
    by mktemp, mode 700, not the predictable gpupool-pilot-USER."""
    name, home = cluster_user
    marks: dict[str, float] = {}
    async with s3_pool(redis_server, s3_env, tmp_path / "pool") as pool:
        config = pilot_config(
            home / "pilot.toml",
            pool,
            "alice",
            owner=name,
            drain_timeout=4.0,
            kill_grace=2.0,
            heartbeat_interval=1.0,
        )
        bobs = (await pool.queue.enqueue(sh("true", timeout=5.0, user="bob")))[0]
        t0 = time.monotonic()
        code, out, err = await poolctl(
            {**slurm.env, "TMPDIR": str(home), "HOME": str(home), "GPUPOOL_USER": "alice"},
            "pilot", "slurm", "--count", "2", "--walltime", "0:02:00", "--gpus-per-node", "0",
            "--config", str(config), "--max-lifetime", str(LIFETIME), "--idle-exit", "0",
            cwd=home, user=name,
        )  # fmt: skip
        assert code == 0, err
        jobs = out.split()
        assert len(jobs) == 2
        assert {slurm.job(j)["UserId"].split("(")[0] for j in jobs} == {name}  # not root's
        marks["sbatch"] = time.monotonic() - t0

        async def both_registered() -> bool:
            workers = await registry.list_workers(pool.queue.redis)
            return sorted(w["batch_job"] for w in workers) == sorted(f"slurm:{j}" for j in jobs)

        try:
            await wait_until(both_registered, 30, "both pilots to register")
        except AssertionError:  # what the pilots said
            logs = [f.read_text() for f in home.glob("gpupool-pilot-*.out")]
            raise AssertionError("\n".join(logs) or "the pilots wrote no log") from None
        marks["ready"] = time.monotonic() - t0
        workers = await registry.list_workers(pool.queue.redis)
        assert all(0 < w["leave_by"] - time.time() <= LIFETIME for w in workers)
        code, table, _ = await poolctl(pool.env(), "workers")
        assert "PILOT" in table.splitlines()[0]
        assert f"slurm:{jobs[0]}, leaves " in table
        assert [line.split()[-1] for line in table.splitlines()] == ["SERVES", "alice", "alice"]

        ran, probe = home / "ran", home / "probe"
        short = [
            (
                await pool.queue.enqueue(
                    sh(f"echo $GPUPOOL_WORKER >> {ran}; sleep 1", timeout=5.0, user="alice")
                )
            )[0]
            for _ in range(3)
        ]
        # what a job can reach of the worker that started it (its parent) and where it runs
        script = (
            f"tr '\\0' ' ' < /proc/$PPID/cmdline > {probe}.cmdline; pwd > {probe}.cwd;"
            f"cat /proc/$PPID/environ > {probe}.environ 2>&1; ls /proc/$PPID/fd/ > {probe}.fd 2>&1;"
            # the config named on the pilot's command line, and every file it names
            f"c=$(tr '\\0' '\\n' < /proc/$PPID/cmdline | grep -A1 -x -- --config | tail -1);"
            f"cat $c > {probe}.config; for f in $(grep -o '\"/[^\"]*\"' $c | tr -d '\"'); do "
            f"cat $f; done > {probe}.named 2>&1; true"
        )
        short.append((await pool.queue.enqueue(sh(script, timeout=5.0, user="alice")))[0])
        # a time limit past the pilots' end, or none: passed over, never started here
        outlives = (await pool.queue.enqueue(sh("true", timeout=600.0, user="alice")))[0]
        endless = (await pool.queue.enqueue(sh("true", user="alice")))[0]
        for job_id in short:
            info = await wait_state(pool.queue, job_id, JobState.SUCCEEDED, JobState.FAILED, timeout=20)
            assert info.state is JobState.SUCCEEDED, info.detail
            marks.setdefault("first job done", time.monotonic() - t0)
        assert set(ran.read_text().split()) <= {w["id"] for w in workers}  # the pilots ran them

        async def draining() -> bool:
            workers = await registry.list_workers(pool.queue.redis)
            return len(workers) < 2 or any(w["health"] == "draining" for w in workers)

        await wait_until(draining, LIFETIME + 10, "the pilots to drain")
        marks["drain seen"] = time.monotonic() - t0

        async def batch_jobs_ended() -> bool:
            return not set(jobs) & set(slurm.queued())

        await wait_until(batch_jobs_ended, LIFETIME + 30, "the pilots' batch jobs to end")
        marks["batch jobs ended"] = time.monotonic() - t0
        for job_id in jobs:
            fields = slurm.job(job_id)
            assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), fields
            log = (home / f"gpupool-pilot-{job_id}.out").read_text()
            assert "leaving: its lifetime ends at" in log, log
            assert "stopped" in log.splitlines()[-1], log
        assert await registry.list_workers(pool.queue.redis) == []  # unregistered, not dead
        for job_id in (outlives, endless, bobs):
            info = await pool.queue.get(job_id)
            assert (info.state, info.attempt) == (JobState.QUEUED, 0), info
        print("pilot timeline (s from the submit):", {k: round(v, 1) for k, v in marks.items()})
        # what the job read lets it act as alice only: bob's job is not hers to cancel
        named = Path(f"{probe}.named").read_text()
        async with pool.client("alice", named.split()[0]) as found:
            assert (await found.call(CancelJobs([bobs]), Cancelled)).states[bobs] == "not_yours"
    # the probe looked at the pilot itself, and was refused its secrets; its config and the files
    # it names hold no pool credential
    assert "daemon.main --worker --config" in Path(f"{probe}.cmdline").read_text()
    seen = Path(f"{probe}.config").read_text() + named
    assert "worker_via_server" in seen
    assert pool.tokens["alice"] in named
    for secret in (redis_server.password, s3_env["GPUPOOL_MAIN_SERVER_MINIO_SECRET_ACCESS_KEY"]):
        assert secret not in seen
    assert "Permission denied" in Path(f"{probe}.environ").read_text()
    assert "Permission denied" in Path(f"{probe}.fd").read_text()
    # each pilot's tree: made anew by mktemp, the cluster user's own, mode 700
    trees = sorted(home.glob("gpupool-pilot.*"))
    assert len(trees) == 2, trees
    for tree in trees:
        st = tree.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (pwd.getpwnam(name).pw_uid, 0o700)
    assert any(Path(f"{probe}.cwd").read_text().startswith(str(t)) for t in trees)
    assert not (home / f"gpupool-pilot-{name}").exists()


async def test_sbatch_refusing_the_script_is_one_sentence(tmp_path: Path, slurm: SlurmCluster) -> None:
    config = plain_config(tmp_path / "pool.toml")
    code, out, err = await poolctl(
        slurm.env, "pilot", "slurm", "--walltime", "0:10:00", "--gpus-per-node", "0", "--partition", "nope",
        "--config", str(config), cwd=tmp_path,
    )  # fmt: skip
    assert (code, out) == (1, "")
    assert err.startswith("poolctl: sbatch refused the pilot: sbatch: error: ")
    assert "invalid partition" in err.lower()
    assert len(err.strip().splitlines()) == 1


@pytest.mark.timeout(90)
async def test_a_pbs_pilot_submitted_through_a_real_qsub_joins_runs_a_job_and_leaves(
    redis_server: EmbeddedRedis, s3_env: dict[str, str], tmp_path: Path, slurm: SlurmCluster
) -> None:
    """issue 43 item 5 (what to build): `poolctl pilot pbs` submitted for real, through the qsub
    of Debian's slurm-wlm-torque, which hands a PBS script to the local Slurm. That qsub reads no
    script on standard input, as poolctl gave it one (a usage error), and options on its command
    line only. The pilot joins the pool, runs the job waiting there, leaves once idle, and its
    batch job ends COMPLETED, its log in NAME.oJOBID where it was submitted."""
    if shutil.which("qsub", path=slurm.env.get("PATH")) is None:
        pytest.skip("no qsub here: apt-get install slurm-wlm-torque (PBS commands over the local Slurm)")
    timings: dict[str, object] = {"drain_timeout": 1.0, "kill_grace": 1.0, "heartbeat_interval": 1.0}
    async with s3_pool(redis_server, s3_env, tmp_path / "pool") as pool:
        config = pilot_config(tmp_path / "pilot.toml", pool, "alice", None, **timings)
        await _a_pbs_pilot_joins_runs_and_leaves(pool, config, tmp_path, slurm)


async def _a_pbs_pilot_joins_runs_and_leaves(
    pool: Pool, config: Path, tmp_path: Path, slurm: SlurmCluster
) -> None:
    queue = pool.queue
    ran = tmp_path / "ran"
    job_id, _ = await queue.enqueue(sh(f"echo $GPUPOOL_WORKER > {ran}", timeout=10.0, user="alice"))
    code, out, err = await poolctl(
        {**slurm.env, "TMPDIR": str(tmp_path), "GPUPOOL_USER": "alice"},
        "pilot", "pbs", "--walltime", "0:02:00", "--gpus-per-node", "0", "--name", "pbs-pilot",
        "--idle-exit", "3", "--config", str(config),
        cwd=tmp_path,
    )  # fmt: skip
    assert code == 0, err
    [batch_job] = out.split()

    async def joined() -> bool:
        # a Slurm job underneath: the pilot names it so (PBS_JOBID is not set)
        return [w["batch_job"] for w in await registry.list_workers(queue.redis)] == [f"slurm:{batch_job}"]

    await wait_until(joined, 30, "the PBS pilot to join the pool")
    [worker] = await registry.list_workers(queue.redis)
    info = await wait_state(queue, job_id, JobState.SUCCEEDED, JobState.FAILED, timeout=20)
    assert info.state is JobState.SUCCEEDED, info.detail
    assert ran.read_text().strip() == worker["id"]

    async def left() -> bool:
        return batch_job not in slurm.queued()

    await wait_until(left, 40, "the PBS pilot's batch job to end")
    fields = slurm.job(batch_job)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), fields
    assert fields["JobName"] == "pbs-pilot", fields
    log = (tmp_path / f"pbs-pilot.o{batch_job}").read_text()
    assert "leaving: no job for " in log, log
    assert "stopped" in log.splitlines()[-1], log
    assert await registry.list_workers(queue.redis) == []


async def test_a_pbs_pilot_asks_slurms_qsub_for_its_gpus(tmp_path: Path, slurm: SlurmCluster) -> None:
    """issue 43 item 5 (what to build): Slurm's qsub (slurm-wlm-torque) hands the script to sbatch,
    which reads `#PBS -l select=1:ngpus=G` without its GPUs: the pilot would start with none, and
    say nothing. Its script asks Slurm for them too (PBS takes that line for a comment); this
    cluster has no GPUs, so Slurm refuses the pilot, and poolctl says why in one sentence."""
    if shutil.which("qsub", path=slurm.env.get("PATH")) is None:
        pytest.skip("no qsub here: apt-get install slurm-wlm-torque (PBS commands over the local Slurm)")
    config = plain_config(tmp_path / "pool.toml")
    code, out, err = await poolctl(
        slurm.env, "pilot", "pbs", "--walltime", "0:10:00", "--gpus-per-node", "2", "--config", str(config),
        cwd=tmp_path,
    )  # fmt: skip
    assert (code, out) == (1, "")
    assert err.strip() == (
        "poolctl: qsub refused the pilot: sbatch: error: Invalid generic resource (gres) specification"
    )
