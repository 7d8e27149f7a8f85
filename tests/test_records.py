"""flame/records.py: the record classes behave as the dataclasses they replace (construction,
defaults, __post_init__, repr, equality, hashing, frozen fields, replace) and reject the same
mistakes."""

from __future__ import annotations

import dataclasses

import pytest

from flame import records
from flame.records import FrozenRecordError, Record, field


class Point(Record, frozen=True):
    x: int
    y: int = 0
    tags: tuple = field(default_factory=tuple)
    note: object = field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class PointDataclass:
    x: int
    y: int = 0
    tags: tuple = dataclasses.field(default_factory=tuple)
    note: object = dataclasses.field(default=None, compare=False, repr=False)


class Counter(Record):
    hits: int = 0
    seen: list = field(default_factory=list)


class Derived(Record, frozen=True):
    base: int

    def __post_init__(self):
        object.__setattr__(self, "double", self.base * 2)


def test_construction_by_position_keyword_and_default():
    for make in (Point, PointDataclass):
        assert (make(1).x, make(1).y, make(1).tags) == (1, 0, ())
        assert make(1, 2).y == 2 and make(x=1, y=3).y == 3
        assert make(1, tags={"a": 1}).tags == {"a": 1}


def test_default_factory_gives_each_record_its_own_value():
    first, second = Counter(), Counter()
    first.seen.append(1)
    assert second.seen == []


def test_repr_matches_the_dataclass_form():
    assert repr(Point(1, 2)) == repr(PointDataclass(1, 2)).replace("PointDataclass", "Point")
    assert "note" not in repr(Point(1, note="hidden"))


def test_equality_and_hash_skip_fields_not_compared():
    assert Point(1, 2, note="a") == Point(1, 2, note="b")
    assert Point(1, 2) != Point(1, 3)
    assert Point(1) != PointDataclass(1)  # another class is never equal
    assert hash(Point(1, 2, note="a")) == hash(Point(1, 2, note="b"))
    assert {Point(1, 2): "v"}[Point(1, 2)] == "v"
    with pytest.raises(TypeError):  # an unhashable value is unhashable, as for the dataclass
        hash(Point(1, tags=({},)))
    with pytest.raises(TypeError):
        hash(PointDataclass(1, tags=({},)))


def test_mutable_records_are_unhashable_and_assignable():
    counter = Counter()
    counter.hits += 1
    assert counter.hits == 1 and counter == Counter(hits=1)
    with pytest.raises(TypeError):
        hash(counter)


def test_frozen_fields_cannot_be_assigned_or_deleted():
    point = Point(1)
    with pytest.raises(FrozenRecordError, match="'x'"):
        point.x = 2
    with pytest.raises(FrozenRecordError):
        del point.y
    assert isinstance(FrozenRecordError(), AttributeError)
    assert point.x == 1


def test_post_init_runs_on_construction_and_on_replace():
    derived = Derived(3)
    assert derived.double == 6
    assert records.replace(derived, base=5).double == 10


def test_replace_and_fields():
    point = Point(1, 2, note="kept")
    moved = records.replace(point, y=7)
    assert (moved.x, moved.y, moved.note, point.y) == (1, 7, "kept", 2)
    assert [spec.name for spec in records.fields(point)] == ["x", "y", "tags", "note"]
    assert records.fields(Point) is records.fields(point)
    with pytest.raises(TypeError, match="z"):
        records.replace(point, z=1)


@pytest.mark.parametrize(
    "arguments, keywords, message",
    [
        ((), {}, "missing required argument 'x'"),
        ((1, 2, {}, None, 5), {}, "takes 4 arguments but 5 were given"),
        ((1,), {"x": 2}, "multiple values for argument 'x'"),
        ((1,), {"z": 2}, r"unexpected keyword arguments \['z'\]"),
    ],
)
def test_wrong_arguments_name_the_problem(arguments, keywords, message):
    with pytest.raises(TypeError, match=message):
        Point(*arguments, **keywords)


def test_declaration_mistakes_are_rejected():
    with pytest.raises(TypeError, match="'b' has no default"):

        class Wrong(Record):
            a: int = 0
            b: int

    with pytest.raises(ValueError, match="not both"):
        field(default=1, default_factory=list)
    with pytest.raises(TypeError, match="cannot extend another record"):

        class Extended(Point):
            z: int = 0


def test_the_runtime_records_build_no_code():
    """The point of the module: the planner's records are made without dataclasses (whose
    generated methods cost 7 ms of a warm start's first result on Python 3.12)."""
    from flame.codegen.common import Read
    from flame.codegen.elementwise import Lowered
    from flame.codegen.spec import Arg, KernelSpec
    from flame.runtime.compiler import CacheStats
    from flame.runtime.device import DeviceInfo
    from flame.runtime.executor import LibraryCall, Plan
    from flame.runtime.launch import Launch

    for cls in (Read, Lowered, Arg, KernelSpec, CacheStats, DeviceInfo, LibraryCall, Plan, Launch):
        assert issubclass(cls, Record) and not dataclasses.is_dataclass(cls), cls.__name__
