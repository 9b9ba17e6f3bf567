"""A job spec from outside is checked field by field, each refusal naming the field."""

from __future__ import annotations

import argparse
import dataclasses

import msgpack
import pytest

from daemon.ctl.enqueue_args import job_mem_size
from daemon.errors import InvalidJob
from daemon.job import JobSpec


@pytest.mark.parametrize(
    ("field", "spec"),
    [
        ("argv", {"argv": ["sh", "-c", "echo a\x00b"]}),
        ("env", {"argv": ["true"], "env": {"A": "x\x00y"}}),
        ("env", {"argv": ["true"], "env": {"A\x00B": "x"}}),
        ("cwd", {"argv": ["true"], "cwd": "/tmp/a\x00b"}),
    ],
)
def test_a_nul_byte_is_refused_where_no_program_could_take_it(field: str, spec: dict[str, object]) -> None:
    """An exec cannot pass a NUL in an argument, a variable or a path: refused at submit, saying
    where, rather than cut short (or failing) on the worker."""
    with pytest.raises(InvalidJob) as err:
        JobSpec.from_dict(spec)
    assert err.value.field == field
    assert "NUL" in str(err.value)


@pytest.mark.parametrize(
    ("spec", "field", "says"),
    [
        ({"stop_signal": "KILL"}, "stop_signal", "one of TERM, INT, HUP, USR1, USR2, QUIT"),
        ({"stop_signal": 15}, "stop_signal", "not 15"),
        ({"stop_grace": 7200}, "stop_grace", "at most 3600 seconds"),
        ({"stop_grace": -1}, "stop_grace", "positive number of seconds"),
        ({"priority": 101}, "priority", "an integer from 0 to 100"),
        ({"checkpoint_every": 0}, "checkpoint_every", "positive number of seconds"),
    ],
)
def test_scheduling_fields_are_checked_naming_what_is_allowed(
    spec: dict[str, object], field: str, says: str
) -> None:
    with pytest.raises(InvalidJob) as err:
        JobSpec.from_dict({"argv": ["true"], **spec})
    assert err.value.field == field
    assert says in str(err.value)


def test_a_stop_signal_may_be_named_as_kill_names_it() -> None:
    assert JobSpec.from_dict({"argv": ["true"], "stop_signal": "sigusr1"}).stop_signal == "USR1"


def test_gpu_mem_is_carried_and_checked_like_the_other_counts() -> None:
    """--gpu-mem (issue 17 item 4): bytes on one shared GPU, through to_dict and back."""
    spec = JobSpec.from_dict({"argv": ["true"], "gpu_mem": 20 * 2**30})
    assert spec.gpu_mem == 20 * 2**30
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert JobSpec.from_dict({"argv": ["true"]}).gpu_mem == 0
    assert JobSpec.from_dict({"argv": ["true"], "gpu_mem": None}).gpu_mem == 0
    for bad in (-1, 2**50 + 1, 1.5, "20G", True):
        with pytest.raises(InvalidJob) as err:
            JobSpec.from_dict({"argv": ["true"], "gpu_mem": bad})
        assert err.value.field == "gpu_mem"
        assert "an integer from 0 to 1125899906842624" in str(err.value)


def test_gpu_mem_and_whole_gpus_exclude_each_other() -> None:
    with pytest.raises(InvalidJob) as err:
        JobSpec.from_dict({"argv": ["true"], "gpus": 1, "gpu_mem": 2**30})
    assert err.value.field == "gpu_mem"
    assert str(err.value) == (
        "job gpu_mem: --gpu-mem asks for memory on one shared GPU; drop --gpus (or --gpu-mem for whole GPUs)"
    )
    assert JobSpec.from_dict({"argv": ["true"], "gpus": 1, "gpu_mem": 0}).gpus == 1


def test_a_tty_job_and_its_idle_limit_are_carried_checked_and_written_only_when_set() -> None:
    """Issue 49, `shell`: a tty job (`tty`, `idle_limit` seconds) goes through to_dict and back;
    a spec without them writes neither key (a worker of before refuses keys it does not know);
    an idle limit is refused on a job without a terminal, and must be a positive number."""
    spec = JobSpec.from_dict({"argv": ["bash"], "tty": True, "idle_limit": 2})
    assert (spec.tty, spec.idle_limit) == (True, 2.0)
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert {"tty", "idle_limit"}.isdisjoint(JobSpec(argv=("true",)).to_dict())
    with pytest.raises(InvalidJob) as err:
        JobSpec.from_dict({"argv": ["true"], "idle_limit": 60})
    assert err.value.field == "idle_limit"
    assert "this job has no terminal" in str(err.value)
    for bad in (0, -1, "1h", True):
        with pytest.raises(InvalidJob) as err:
            JobSpec.from_dict({"argv": ["bash"], "tty": True, "idle_limit": bad})
        assert err.value.field == "idle_limit"


def test_a_spec_from_outside_is_what_a_worker_reads_back_from_its_packed_bytes() -> None:
    """A standing claim hands its enqueue's JobSpec to the worker rather than decode the packed
    bytes Redis holds (claims.Claims._claim_reply): the two are the same spec, every field set."""
    sha = "ab" * 32
    spec = dataclasses.replace(
        JobSpec.from_dict(
            {
                "argv": ["python", "train.py", "--lr", "0.1"],
                "queue": "gpu",
                "name": "train",
                "env": {"A": "1", "B": ""},
                "gpus": 2,
                "wait_for_worker": True,
                "timeout": 3600,
                "checkpoint_every": 60.5,
                "stop_signal": "INT",
                "stop_grace": 30,
                "max_attempts": 5,
                "retries": 2,
                "priority": 7,
                "git": {"repo": "https://example.com/r.git", "commit": "c" * 40},
                "after": ["gpu.0123456789abcdef:ok"],
                "notify": "https://example.com/hook",
                "array": "gpu@0123456789abcdef",
                "array_index": 3,
                "array_pos": 3,
                "array_limit": 2,
            }
        ),
        user="alice",
    )
    assert JobSpec.from_dict(msgpack.unpackb(msgpack.packb(spec.to_dict()))) == spec
    snapshot = {"snapshot": {"sha256": sha, "commit": "c" * 40, "dirty": True}}
    inputs = {"inputs": [{"sha256": sha, "dest": "data/x", "kind": "file"}]}
    for extra in (snapshot, inputs):
        other = JobSpec.from_dict({"argv": ["true"], "gpu_mem": 2**30, **extra})
        assert JobSpec.from_dict(msgpack.unpackb(msgpack.packb(other.to_dict()))) == other


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("gpus", False),  # == 0, the default, but a bool
        ("gpus", 0.0),
        ("max_attempts", 3.0),  # == 3
        ("retries", False),
        ("wait_for_worker", 0),  # == False, but not a bool
        ("timeout", 0),
        ("name", 0),
        ("queue", None),
        ("stop_signal", None),
        ("inputs", {}),
    ],
)
def test_a_value_equal_to_a_default_but_of_another_type_is_still_checked(field: str, value: object) -> None:
    """from_dict takes a field given as its default without a check (a stored spec gives every
    field, most as their defaults): only the very default, of its own type, passes unchecked."""
    with pytest.raises(InvalidJob) as err:
        JobSpec.from_dict({"argv": ["true"], field: value})
    assert err.value.field == field


def test_every_field_given_as_its_default_is_the_default_spec() -> None:
    """What a worker decodes: to_dict writes every field, defaults and all."""
    bare = JobSpec(argv=("true",))
    stored = msgpack.unpackb(msgpack.packb(bare.to_dict()))
    assert JobSpec.from_dict(stored) == bare
    given = JobSpec.from_dict({**stored, "gpus": 2, "queue": "gpu"})
    assert given == dataclasses.replace(bare, gpus=2, queue="gpu")
    with pytest.raises(InvalidJob) as err:
        JobSpec.from_dict({**stored, "colour": "red", "brightness": 1})
    assert err.value.field == "brightness"  # the first unknown one, by name


def test_a_jobs_memory_is_none_or_at_least_a_mib() -> None:
    """issue 50, a review's finding: `--mem 4096` (a Slurm user's MiB) was 4096 bytes, and the job
    was killed by its memory limit at once. A spec's `mem` is none (0) or at least a MiB, and
    poolctl refuses a size under a MiB saying to give a unit."""
    assert JobSpec.from_dict({"argv": ["true"], "mem": 2**20}).mem == 2**20
    with pytest.raises(InvalidJob, match="at least 1 MiB"):
        JobSpec.from_dict({"argv": ["true"], "mem": 4096})
    with pytest.raises(argparse.ArgumentTypeError, match=r"give a unit, e\.g\. 4096M"):
        job_mem_size("4096")
    assert job_mem_size("4096M") == 4096 * 2**20
