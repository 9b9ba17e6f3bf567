"""How poolctl reads its command line: a mistake is one line, and every number is in its range.

argparse answers a mistake with the command's whole usage (fourteen lines for `enqueue`) before
the one line that says what was wrong; poolctl prints that line alone, and where the usage is.
A number's range is part of its option's type (`Number`): the parser refuses to build an int or
float option without one (`Parser.add_argument`), so no command takes `--limit -1` or
`--timeout -5` as a value it then misreads.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any, NoReturn

from daemon.errors import GpupoolError
from protocol import ErrorCode


class UsageError(GpupoolError):
    """The command line asks for something poolctl cannot do; exits EXIT_USAGE."""

    code = ErrorCode.INVALID_ARGUMENT


class Parser(argparse.ArgumentParser):
    """poolctl's parser and, through add_subparsers, each command's."""

    def error(self, message: str) -> NoReturn:
        """One line and exit status 2 (a usage error): what was wrong, and where the usage is."""
        what = message.removeprefix("argument ")
        self.exit(2, f"poolctl: {what} (see {self.prog} --help)\n")

    def parse_all(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """parse_args, except that an argument no command takes is refused by the command's own
        parser, whose --help lists what it does take (argparse leaves that to poolctl's)."""
        args, extra = self.parse_known_args(argv)
        if extra:
            commands = next(a for a in self._actions if isinstance(a, argparse._SubParsersAction))
            command: argparse.ArgumentParser = commands.choices[getattr(args, commands.dest)]
            command.error(f"unrecognized arguments: {' '.join(extra)}")
        return args

    def add_argument(self, *name_or_flags: str, **kwargs: Any) -> argparse.Action:
        """An option; one that takes a number must say its range, with a `Number` type."""
        if kwargs.get("type") in (int, float):
            raise TypeError(f"{name_or_flags[0]}: give a number's option a Number type, with its range")
        return super().add_argument(*name_or_flags, **kwargs)


class Number:
    """An argparse type: a finite number of `kind` (int: a whole number) from `least` to `most`
    (None: no bound above); with `above`, `least` itself is refused (a positive number). `unit`
    names what it counts, for the sentence that refuses a value. (A plain class: a one-request
    command loads no dataclasses, test_imports.py)"""

    __slots__ = ("above", "kind", "least", "most", "unit")

    def __init__(
        self,
        kind: type[int] | type[float],
        least: float,
        most: float | None = None,
        *,
        above: bool = False,
        unit: str = "",
    ) -> None:
        self.kind, self.least, self.most, self.above, self.unit = kind, least, most, above, unit

    def __call__(self, text: str) -> int | float:
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {self.described()}, not {text!r}") from None
        if not (
            math.isfinite(value)
            and (value > self.least if self.above else value >= self.least)
            and (self.most is None or value <= self.most)
        ):
            raise argparse.ArgumentTypeError(f"expected {self.described()}, not {text!r}")
        return value

    def described(self) -> str:
        """The values it takes, in words: "a whole number from 1 to 10000"."""
        noun = "a whole number" if self.kind is int else "a number"
        noun += f" of {self.unit}" if self.unit else ""
        least, most = _written(self.least), None if self.most is None else _written(self.most)
        if self.above and self.least == 0:
            noun = noun.replace("a ", "a positive ", 1)
            return noun if most is None else f"{noun} up to {most}"
        if not self.above and most is not None:
            return f"{noun} from {least} to {most}"
        lower = f"above {least}" if self.above else f"of at least {least}"
        return f"{noun} {lower}" + ("" if most is None else f" and at most {most}")


def _written(number: float) -> str:
    """A bound as a person writes it: 1000000, 0.5 (not 1e+06, 1000000.0)."""
    return str(int(number)) if number == int(number) else f"{number:g}"


def whole(least: int, most: int) -> Number:
    """A whole number from `least` to `most`: bounded above too, since a number past what the
    wire carries (msgpack: 64 bits) would fail as it is sent, not as it is read."""
    return Number(int, least, most)


def seconds(least: float = 0, most: float | None = None, *, above: bool = True) -> Number:
    """A number of seconds: above `least` (at least it, without `above`), up to `most`."""
    return Number(float, least, most, above=above, unit="seconds")
