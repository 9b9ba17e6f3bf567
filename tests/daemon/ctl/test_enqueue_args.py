"""`poolctl enqueue --gpu-mem SIZE` (issue 17 item 4): sizes as people write them, one-line refusals
of the rest, the spec it sends, and how `show` and `workers` print a shared GPU."""

from __future__ import annotations

import pytest

from daemon import job, spec_checks
from daemon.ctl import commands, enqueue_args, render
from daemon.ctl.enqueue_spec import spec_of
from daemon.errors import InvalidJob
from tests.support.pool import Pool
from tests.support.poolctl import poolctl

G = 2**30


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("20G", 20 * G),
        ("20GiB", 20 * G),
        ("20gb", 20 * G),
        ("20 G", 20 * G),
        ("512M", 512 * 2**20),
        ("1.5T", 3 * 2**39),
        (".5k", 512),
        ("4096", 4096),
        ("100B", 100),
        ("1024T", 2**50),
    ],
)
def test_sizes_are_read_in_powers_of_1024(text: str, size: int) -> None:
    assert enqueue_args.gpu_mem_size(text) == size


@pytest.mark.parametrize(
    "text", ["", "G", "20X", "-1G", "1.5.2G", "20 GiBs", "20iB", "1e9", "0", "0.1B", "1025T"]
)
def test_anything_else_is_not_a_size(text: str) -> None:
    with pytest.raises(Exception, match="is not a size"):
        enqueue_args.gpu_mem_size(text)


def test_a_bad_size_is_a_usage_error_of_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        commands.parser().parse_args(["enqueue", "--gpu-mem", "lots", "--", "true"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "poolctl: --gpu-mem: 'lots' is not a size: expected a number and a unit, e.g. 20G, 512M or "
        "1.5T (see poolctl enqueue --help)\n"
    )


def test_the_spec_carries_it_only_when_asked_and_never_with_gpus() -> None:
    args = commands.parser().parse_args(["enqueue", "--gpu-mem", "20G", "--", "python", "train.py"])
    spec = spec_of(args)
    assert (spec["gpu_mem"], spec["gpus"]) == (20 * G, 0)
    assert job.JobSpec.from_dict(spec).gpu_mem == 20 * G
    assert "gpu_mem" not in spec_of(commands.parser().parse_args(["enqueue", "--gpus", "2", "--", "true"]))
    both = commands.parser().parse_args(["enqueue", "--gpus", "1", "--gpu-mem", "20G", "--", "true"])
    with pytest.raises(InvalidJob, match=r"--gpu-mem asks for memory on one shared GPU; drop --gpus"):
        spec_of(both)


def test_poolctl_says_the_same_limit_as_the_job_model() -> None:
    assert enqueue_args.GPU_MEM_MAX == spec_checks.GPU_MEM_MAX
    assert (enqueue_args.ATTEMPTS_MAX, enqueue_args.PRIORITY_MAX, enqueue_args.STOP_GRACE_MAX) == (
        spec_checks.MAX_ATTEMPTS_LIMIT,
        spec_checks.PRIORITY_MAX,
        spec_checks.MAX_STOP_GRACE,
    )
    assert job.JobSpec.from_dict({"argv": ["true"], "gpus": enqueue_args.GPUS_MAX}).gpus == 1024
    with pytest.raises(InvalidJob, match="gpus"):
        job.JobSpec.from_dict({"argv": ["true"], "gpus": enqueue_args.GPUS_MAX + 1})


def test_show_prints_the_memory_on_a_shared_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    record = {
        "id": "default.0mzk4g8x1a2b", "state": "queued", "cancel_requested": False, "worker": "",
        "spec": job.JobSpec(argv=("train",), gpu_mem=20 * G, user="alice").to_dict(),
        "attempt": 0, "enqueued_at": 0.0, "started_at": None, "ended_at": None, "exit_code": None,
        "detail": "", "attempts": [], "result": {},
    }  # fmt: skip
    render.job(record, as_json=False)
    out = capsys.readouterr().out
    assert "gpu mem:   20 GiB on a shared GPU" in out
    assert "gpus:" not in out
    record["spec"] = {**record["spec"], "gpu_mem": 1536 * 2**20}  # type: ignore[dict-item]
    render.job(record, as_json=False)
    assert "gpu mem:   1.5 GiB on a shared GPU" in capsys.readouterr().out


def test_show_prints_the_cpus_and_memory_a_job_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    """issue 50: `poolctl show` says a job's --cpus and --mem, and a limit that the model and
    poolctl say alike."""
    assert (enqueue_args.CPUS_MAX, enqueue_args.MEM_MIN) == (spec_checks.CPUS_MAX, spec_checks.MEM_MIN)
    record = {
        "id": "default.0mzk4g8x1a2b", "state": "queued", "cancel_requested": False, "worker": "",
        "spec": job.JobSpec(argv=("train",), cpus=4, mem=16 * G, user="alice").to_dict(),
        "attempt": 0, "enqueued_at": 0.0, "started_at": None, "ended_at": None, "exit_code": None,
        "detail": "", "attempts": [], "result": {},
    }  # fmt: skip
    render.job(record, as_json=False)
    out = capsys.readouterr().out
    assert "cpus:      4\n" in out
    assert "mem:       16 GiB\n" in out


def test_workers_counts_the_gpus_shared_and_the_jobs_on_them() -> None:
    gpu = {"name": "H100", "memory": 80 * G, "job": "", "shared": {}, "quarantined": ""}
    gpus = [
        gpu | {"job": "a#1"},
        gpu | {"shared": {"b#1": 20 * G, "c#1": 20 * G}, "shared_memory": 40 * G},
        gpu | {"shared": {"d#1": G}},
        gpu,
    ]
    [row] = render.worker_rows([{"id": "w1", "gpus": gpus}]).rows
    assert "4x H100 (80 GiB), 1 busy, 2 shared by 3 jobs" in row


async def test_poolctl_enqueues_and_shows_a_gpu_mem_job(pool: Pool) -> None:
    env = pool.env("alice")
    code, _, err = await poolctl(env, "enqueue", "--gpus", "1", "--gpu-mem", "20G", "--", "true")
    assert code == 2
    assert "drop --gpus (or --gpu-mem for whole GPUs)" in err
    code, _, err = await poolctl(env, "enqueue", "--gpu-mem", "twenty", "--", "true")
    assert (code, "is not a size" in err) == (2, True)
    code, out, err = await poolctl(env, "enqueue", "--gpu-mem", "20GiB", "--", "true")
    assert code == 2  # no worker has joined, so no GPU that large: refused in a sentence (a usage error)
    assert "needs 20.0 GiB on one GPU; no worker serving queue 'default' has joined" in err
    code, out, err = await poolctl(env, "enqueue", "--gpu-mem", "20GiB", "--wait-for-worker", "--", "true")
    assert code == 0, err
    code, out, _ = await poolctl(env, "show", out.strip())
    assert "gpu mem:   20 GiB on a shared GPU" in out


def test_the_issues_names_for_the_stop_signal_and_grace_are_the_same_options() -> None:
    """Issue 17 writes `--signal` and `--checkpoint-grace`; poolctl's names are `--stop-signal` and
    `--stop-grace` (they stop a cancel and a timeout too): both spellings work."""
    argv = ["enqueue", "--signal", "USR1", "--checkpoint-grace", "120", "--", "python", "train.py"]
    spec = spec_of(commands.parser().parse_args(argv))
    assert (spec["stop_signal"], spec["stop_grace"]) == ("USR1", 120.0)
