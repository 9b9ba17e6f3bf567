"""A job spec from outside is checked field by field, each refusal naming the field."""

from __future__ import annotations

import pytest

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
