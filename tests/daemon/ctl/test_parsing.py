"""poolctl's command line (daemon/ctl/parsing.py): every number of every command has a range, and
a plain int or float option cannot be added. What a mistake prints: test_poolctl.py's BAD_INPUTS."""

from __future__ import annotations

import argparse

import pytest

from daemon.ctl.commands import parser as poolctl_parser
from daemon.ctl.enqueue_args import gpu_mem_size, job_mem_size
from daemon.ctl.parsing import Number, Parser


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """poolctl's parser, and each command's, by name."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"poolctl": parser, **sub.choices}


def test_every_numeric_option_of_every_command_states_its_range() -> None:
    """issue 47 item 9: `wait --timeout -5` and `ls --limit -1` were taken, as any option typed
    int or float takes any number; each is now a Number, whose range refuses such a value."""
    numeric = {
        f"{name} {action.option_strings[0]}": action.type
        for name, parser in commands(poolctl_parser()).items()
        for action in parser._actions
        if action.type in (int, float)
        or isinstance(action.type, Number)
        or (isinstance(action.default, int | float) and not isinstance(action.default, bool))
    }
    assert {"ls --limit", "wait --timeout", "top -d", "enqueue --gpus", "pilot --count"} <= set(numeric)
    sizes = (gpu_mem_size, job_mem_size)  # a size with its unit, from 1 byte (a job's memory: 1 MiB) to 1024T
    ranged = [o for o, kind in numeric.items() if isinstance(kind, Number) or kind in sizes]
    assert ranged == list(numeric)
    with pytest.raises(TypeError, match="give a number's option a Number type, with its range"):
        Parser().add_argument("--count", type=int)


def test_a_number_out_of_its_range_or_not_finite_is_refused_in_words() -> None:
    limit = Number(int, 1, 10_000)
    assert limit("5") == 5
    for text in ("0", "10001", "x", "1.5"):
        with pytest.raises(
            argparse.ArgumentTypeError, match=f"expected a whole number from 1 to 10000, not '{text}'"
        ):
            limit(text)
    timeout = Number(float, 0, unit="seconds")
    assert timeout("0") == 0
    for text in ("-5", "nan", "inf", "-inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="a number of seconds of at least 0"):
            timeout(text)
    with pytest.raises(argparse.ArgumentTypeError, match="expected a positive number of seconds up to 3600"):
        Number(float, 0, 3600, above=True, unit="seconds")("0")
