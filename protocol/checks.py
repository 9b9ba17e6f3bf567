"""Strict type checks for message fields, driven by the records' own annotations.

A message class declares its fields with ordinary annotations (``list[str]``, ``int | None``, ...);
:func:`build` looks each annotation up in :data:`_CHECKS` and checks the decoded msgpack value
against it, so adding a message never means writing a parser. Checks use ``type(x) is T`` rather
than ``isinstance``: msgpack only produces exact built-in types, and ``True`` must not pass as an
integer.
"""

import math
from collections.abc import Callable
from typing import Any, Final, TypeAlias

from protocol.errors import ErrorCode, RemoteProtocolError
from protocol.record import defaults, field_types

__all__ = ["bad_field", "build", "schema"]

# A checker takes (where, value) and returns the value, or raises naming ``where``.
_Check: TypeAlias = Callable[[str, object], object]


def bad_field(where: str, expected: str, value: object) -> RemoteProtocolError:
    return RemoteProtocolError(
        ErrorCode.BAD_PAYLOAD,
        f"Field {where} must be {expected}, not {type(value).__name__}; fix the program that sent it.",
    )


def _scalar(kind: type, expected: str) -> _Check:
    def check(where: str, value: object) -> object:
        # type() rather than isinstance(): True must not pass as an int.
        if type(value) is not kind:
            raise bad_field(where, expected, value)
        return value

    return check


def _float(where: str, value: object) -> object:
    # Other languages may encode 2.0 as the integer 2; accept that, but never bool, NaN or infinity.
    if type(value) is int:
        value = float(value)
    if type(value) is not float or not math.isfinite(value):
        raise bad_field(where, "a finite number", value)
    return value


def _map(where: str, value: object) -> object:
    # unpack_payload already insists on str keys in every map; a dict here is a map with str keys.
    if type(value) is not dict:
        raise bad_field(where, "a map with string keys", value)
    return value


def _optional(check: _Check) -> _Check:
    def optional(where: str, value: object) -> object:
        return None if value is None else check(where, value)

    return optional


def _list_of(check: _Check, expected: str) -> _Check:
    def list_of(where: str, value: object) -> object:
        if type(value) is not list:
            raise bad_field(where, expected, value)
        return [check(f"{where}[{index}]", item) for index, item in enumerate(value)]

    return list_of


_str = _scalar(str, "a string")
_int = _scalar(int, "an integer")


def _str_map(where: str, value: object) -> object:
    _map(where, value)
    assert isinstance(value, dict)
    for key, item in value.items():
        _str(f"{where}[{key!r}]", item)
    return value


_CHECKS: Final[dict[object, _Check]] = {
    str: _str,
    int: _int,
    float: _float,
    bool: _scalar(bool, "true or false"),
    bytes: _scalar(bytes, "binary (msgpack bin)"),
    str | None: _optional(_str),
    int | None: _optional(_int),
    float | None: _optional(_float),
    list[int]: _list_of(_int, "an array of integers"),
    list[str]: _list_of(_str, "an array of strings"),
    list[dict[str, Any]]: _list_of(_map, "an array of maps"),
    dict[str, Any]: _map,
    dict[str, str]: _str_map,
}


_SCHEMAS: Final[dict[type[Any], tuple[tuple[str, _Check], ...]]] = {}


def schema(cls: type[Any]) -> tuple[tuple[str, _Check], ...]:
    """(field name, checker) for each field of ``cls``; KeyError if a field type has no checker."""
    found = _SCHEMAS.get(cls)
    if found is None:
        found = _SCHEMAS[cls] = tuple((n, _CHECKS[t]) for n, t in field_types(cls).items())
    return found


def _name(cls: type[Any]) -> str:
    return getattr(cls, "OP", None) or cls.__name__


def build(cls: type[Any], payload: dict[str, Any]) -> Any:
    """Check ``payload`` against the fields of ``cls`` and construct it; unknown keys are ignored.
    A field with a default was added by a later version: a sender that predates it leaves it out,
    and means its default."""
    values = {}
    for name, check in schema(cls):
        if name not in payload and name in defaults(cls):
            values[name] = defaults(cls)[name]
            continue
        if name not in payload:
            raise RemoteProtocolError(
                ErrorCode.BAD_PAYLOAD,
                f"Field {_name(cls)}.{name} is missing; every field is required (send nil for none).",
            )
        values[name] = check(f"{_name(cls)}.{name}", payload[name])
    return cls(**values)
