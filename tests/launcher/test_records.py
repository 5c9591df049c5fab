"""`records.Record`: what the agent's messages and the contract's records rely on from
`dataclasses` (construction, defaults, equality, hashing, repr, frozenness, inheritance,
pattern matching, replace), checked side by side with a dataclass of the same declaration."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest

from records import FrozenRecordError, Record, asdict, field, fields, replace


class Point(Record, frozen=True):
    x: int
    y: int = 0
    tags: list[str] = field(default_factory=list)
    unit: ClassVar[str] = "m"  # a class constant, not a field


@dataclasses.dataclass(frozen=True)
class DataPoint:
    x: int
    y: int = 0
    tags: list[str] = dataclasses.field(default_factory=list)
    unit: ClassVar[str] = "m"


class Labelled(Point, frozen=True):
    label: str = ""


class Pair(Record, frozen=True):
    a: int
    b: int


class Counter(Record):
    name: str
    hits: int = 0


def test_a_record_is_built_like_the_dataclass_of_the_same_declaration():
    for args, kwargs in [((1,), {}), ((1, 2), {}), ((), {"x": 1, "tags": ["a"]}),
                         ((1,), {"y": 5})]:
        record, data = Point(*args, **kwargs), DataPoint(*args, **kwargs)
        assert repr(record) == repr(data).replace("DataPoint", "Point")
        assert asdict(record) == dataclasses.asdict(data)
        assert vars(record) == vars(data)  # every field on the instance, in order
    assert fields(Point) == tuple(f.name for f in dataclasses.fields(DataPoint))
    assert Point.unit == "m" and "unit" not in fields(Point)


def test_each_record_gets_its_own_default_from_a_factory():
    a, b = Point(1), Point(2)
    a.tags.append("mine")
    assert b.tags == [] and Point(3).tags == []
    assert "tags" not in Point.__dict__  # no shared list left on the class


def test_a_frozen_record_refuses_changes_and_hashes_by_value():
    p = Point(1, 2)
    with pytest.raises(FrozenRecordError, match="'x' of a frozen Point"):
        p.x = 5  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del p.y  # type: ignore[misc]
    assert p == Point(1, 2) and p != Point(1, 3)
    assert hash(Pair(1, 2)) == hash(Pair(1, 2)) and len({Pair(1, 2), Pair(1, 2), Pair(2, 1)}) == 2
    with pytest.raises(TypeError, match="unhashable type: 'list'"):  # as a dataclass's
        hash(p)


def test_a_mutable_record_takes_assignments_and_is_unhashable():
    c = Counter("a")
    c.hits += 1
    assert c == Counter("a", 1)
    with pytest.raises(TypeError, match="unhashable"):
        hash(c)


def test_records_of_different_classes_are_never_equal():
    assert Point(1, 2) != Labelled(1, 2)
    assert Point(1, 2) != DataPoint(1, 2)
    assert Point(1, 2) != (1, 2, [])


def test_a_subclass_adds_its_fields_after_its_bases():
    item = Labelled(1, 2, ["t"], "corner")
    assert fields(Labelled) == ("x", "y", "tags", "label")
    assert repr(item) == "Labelled(x=1, y=2, tags=['t'], label='corner')"
    assert Labelled(1).label == "" and Labelled(1).tags == []
    match item:
        case Labelled(x, y, _, label):
            assert (x, y, label) == (1, 2, "corner")
        case _:
            pytest.fail("a record matches by its fields in order")


@pytest.mark.parametrize("args,kwargs,message", [
    ((1, 2, [], 4), {}, "takes 3 positional arguments but 4 were given"),
    ((), {}, "missing argument: 'x'"),
    ((1,), {"colour": "red"}, "unexpected or repeated arguments: 'colour'"),
    ((1,), {"x": 2}, "unexpected or repeated arguments: 'x'"),
])
def test_wrong_arguments_are_a_type_error_naming_them(args, kwargs, message):
    with pytest.raises(TypeError, match=message):
        Point(*args, **kwargs)


def test_replace_makes_a_changed_copy_and_checks_the_names():
    p = Labelled(1, 2, label="a")
    q = replace(p, y=7)
    assert q == Labelled(1, 7, label="a") and p.y == 2
    with pytest.raises(TypeError, match="'z'"):
        replace(p, z=1)
