"""Record: a frozen, slotted class of named fields, declared as a frozen dataclass is, made cheaply.

The wire's vocabulary is some forty small immutable classes, and every `poolctl` command defines
them all before it sends a byte. As frozen, slotted dataclasses they cost an import of
`dataclasses` (it pulls in `inspect`) and a build of each class (twice, for its slots, with half a
dozen methods compiled for it): a large part of a command's start. A `Record` is
built once, with one compiled `__init__`; equality, hashing and repr are shared by all. (msgspec's
Struct does the same in C but takes longer to import than the classes it saves.)

    class Hello(Record):
        FRAME: ClassVar = FrameType.HELLO   # a class constant, not a field
        versions: list[int]
        user: str

Fields are the annotated names in order, positional or by keyword; a default must be immutable.
Instances cannot be changed; `fields(cls)` gives the names and `field_types(cls)` their types.
No inheritance between records: each declares all of its fields.
"""

from __future__ import annotations

from typing import Any, ClassVar, dataclass_transform

__all__ = ["Record", "defaults", "field_types", "fields"]

_IMMUTABLE_DEFAULTS = (type(None), bool, int, float, str, bytes, tuple, frozenset)


def _is_class_var(annotation: object) -> bool:
    if isinstance(annotation, str):  # postponed annotations: `from __future__ import annotations`
        return annotation == "ClassVar" or annotation.startswith(("ClassVar[", "typing.ClassVar"))
    return annotation is ClassVar or getattr(annotation, "__origin__", None) is ClassVar


@dataclass_transform(frozen_default=True)
class _RecordMeta(type):
    def __new__(mcs, name: str, bases: tuple[type, ...], namespace: dict[str, Any]) -> _RecordMeta:
        annotations = namespace.get("__annotations__", {})
        names = tuple(n for n, a in annotations.items() if not _is_class_var(a))
        if any(getattr(b, "__record_fields__", ()) for b in bases):
            raise TypeError(f"{name}: a Record cannot extend another record; declare every field")
        defaults = {n: namespace.pop(n) for n in names if n in namespace}
        for n, value in defaults.items():
            if not isinstance(value, _IMMUTABLE_DEFAULTS):
                raise TypeError(f"{name}.{n}: a default must be immutable, not {type(value).__name__}")
        namespace["__slots__"] = names
        namespace["__match_args__"] = names
        namespace["__record_fields__"] = names
        namespace["__record_defaults__"] = defaults
        if names:
            namespace["__init__"] = _make_init(name, names, defaults)
        return super().__new__(mcs, name, bases, namespace)


def _make_init(name: str, names: tuple[str, ...], defaults: dict[str, Any]) -> Any:
    params, seen_default = [], False
    for n in names:
        if n in defaults:
            params.append(f"{n}=_defaults[{n!r}]")
            seen_default = True
        elif seen_default:
            raise TypeError(f"{name}.{n}: a field without a default follows one with a default")
        else:
            params.append(n)
    body = "".join(f"    _set(self, {n!r}, {n})\n" for n in names)
    source = f"def __init__(self, {', '.join(params)}):\n{body}"
    scope: dict[str, Any] = {}
    exec(source, {"_set": object.__setattr__, "_defaults": defaults}, scope)  # noqa: S102 - our text
    init = scope["__init__"]
    init.__qualname__ = f"{name}.__init__"
    return init


class Record(metaclass=_RecordMeta):
    __slots__ = ()
    __record_fields__: ClassVar[tuple[str, ...]] = ()
    __record_defaults__: ClassVar[dict[str, Any]] = {}

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, n) for n in self.__record_fields__)

    def __repr__(self) -> str:
        fields_text = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__record_fields__)
        return f"{type(self).__qualname__}({fields_text})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self), self._values()))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"cannot assign to field {name!r}: a {type(self).__name__} is frozen")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r}: a {type(self).__name__} is frozen")

    def __reduce__(self) -> tuple[Any, ...]:  # copy and pickle, which would assign to the slots
        return (type(self), self._values())


def fields(cls: type[Record] | Record) -> tuple[str, ...]:
    """The names of a record's fields, in order."""
    return cls.__record_fields__


def defaults(cls: type[Record]) -> dict[str, Any]:
    """The fields of a record that have a default, and that default."""
    return cls.__record_defaults__


def field_types(cls: type[Record]) -> dict[str, Any]:
    """Each field's annotation (an object unless its module postponed annotations)."""
    return {n: cls.__annotations__[n] for n in cls.__record_fields__}
