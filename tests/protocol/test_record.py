"""Record (protocol/record.py) behaves as the frozen, slotted dataclass it replaces."""

import copy
import pickle
from typing import ClassVar

import pytest

from protocol.record import Record, field_types, fields


class Point(Record):
    """A point."""

    KIND: ClassVar = "point"
    x: int
    y: int
    label: str = ""


class Empty(Record):
    pass


def test_fields_in_order_class_constants_apart() -> None:
    assert fields(Point) == ("x", "y", "label")
    assert field_types(Point) == {"x": int, "y": int, "label": str}
    assert Point.KIND == "point"
    assert Point.__match_args__ == ("x", "y", "label")
    assert Point.__doc__ == "A point."


def test_positional_keyword_and_default() -> None:
    assert Point(1, 2) == Point(x=1, y=2, label="") == Point(1, y=2)
    assert Point(1, 2, "a").label == "a"
    with pytest.raises(TypeError):
        Point(1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Point(1, 2, z=3)  # type: ignore[call-arg]
    assert Empty() == Empty()


def test_frozen_and_slotted() -> None:
    p = Point(1, 2)
    with pytest.raises(AttributeError, match="frozen"):
        p.x = 5  # type: ignore[misc]
    with pytest.raises(AttributeError, match="frozen"):
        del p.x
    assert not hasattr(p, "__dict__")


def test_equality_hash_and_repr_by_value_and_class() -> None:
    class Other(Record):
        x: int
        y: int
        label: str = ""

    assert Point(1, 2) != Point(2, 1)
    assert Point(1, 2) != Other(1, 2)
    assert hash(Point(1, 2)) == hash(Point(1, 2))
    assert len({Point(1, 2), Point(1, 2), Point(1, 3)}) == 2
    assert repr(Point(1, 2, "a")) == "Point(x=1, y=2, label='a')"


def test_match_positional_and_keyword() -> None:
    match Point(1, 2):
        case Point(1, y, label=""):
            assert y == 2
        case _:
            pytest.fail("did not match")


def test_copy_and_pickle() -> None:
    p = Point(1, 2, "a")
    assert copy.copy(p) == copy.deepcopy(p) == pickle.loads(pickle.dumps(p)) == p


def test_declaration_mistakes_are_refused() -> None:
    with pytest.raises(TypeError, match="immutable"):

        class Bad(Record):
            items: list[int] = []  # noqa: RUF012 - the mistake under test

    with pytest.raises(TypeError, match="follows one with a default"):

        class Order(Record):
            a: int = 0
            b: int  # type: ignore[misc]

    with pytest.raises(TypeError, match="cannot extend"):

        class More(Point):
            z: int  # type: ignore[misc]
