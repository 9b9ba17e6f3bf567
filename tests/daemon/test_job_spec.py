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
