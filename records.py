"""Typed records that cost nothing to define: what `dataclasses` gives the per-host agent's
messages and state, without its price at start-up.

Every host pays its agent's imports before its ranks can start, and on the CPUs the ranks
start on. There, `dataclasses` cost more than a third of the agent's start (26 of 68 ms of
CPU, measured 2026-11-30 by starting the agent's imports 50 times with and without it): its
import pulls in `inspect` (with `ast`, `dis` and `tokenize`), and each class compiles six
methods with `exec` when its module is imported. A `Record` builds nothing when it is
defined: its fields are read from the annotations once, and one `__init__`, `__eq__`,
`__repr__` and `__hash__` serve every record. Creating one takes about 0.3 µs longer.

For the type checker a record is a dataclass (`dataclass_transform`): the constructor's
parameters, their types and defaults are checked as for ``@dataclass``. At run time:

* ``class Frame(Record, frozen=True)``: fields are the annotated class attributes in order
  (a base's first), defaults are their values, ``field(default_factory=...)`` a fresh default
  per instance. ``frozen=True`` refuses assignment and makes the record hashable; otherwise it
  is mutable and unhashable, as a dataclass.
* Equality compares the same class's fields; ``repr`` is ``Name(field=value, ...)``;
  ``__match_args__`` are the fields; every field is set on the instance, in order, so
  ``vars(record)`` is its fields.
* `replace`, `fields` and `asdict` (shallow) stand for their `dataclasses` namesakes.

`launcher/` and `trainer/` share this module as they share `workerenv.py`, whose records are
made of it; it imports nothing.
"""

from __future__ import annotations

TYPE_CHECKING = False  # importing `typing` costs the agent's start-up; mypy reads True
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, ClassVar, TypeVar, dataclass_transform

    T = TypeVar("T")
    R = TypeVar("R", bound="Record")
else:
    def dataclass_transform(**_: object) -> object:
        return lambda cls: cls

_set = object.__setattr__


class Factory:
    """A field's default made fresh for every instance (`field`)."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], object]) -> None:
        self.make = make


def field(*, default_factory: Callable[[], T]) -> T:
    """A default that every instance makes anew: ``sent: list[int] = field(default_factory=list)``
    (typed as the value it makes, as `dataclasses.field`)."""
    return Factory(default_factory)  # type: ignore[return-value]


class FrozenRecordError(AttributeError):
    """Assigning to or deleting a field of a frozen record."""


@dataclass_transform(field_specifiers=(field,))
class Record:
    """The base of every record (see the module's docstring)."""

    __slots__ = ()
    __record_fields__: ClassVar[tuple[str, ...]] = ()
    __record_defaults__: ClassVar[dict[str, object]] = {}

    def __init_subclass__(cls, *, frozen: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        names = list(cls.__record_fields__)
        defaults = dict(cls.__record_defaults__)
        for name, hint in cls.__dict__.get("__annotations__", {}).items():
            if str(hint).startswith(("ClassVar", "typing.ClassVar")):
                continue
            if name not in names:
                names.append(name)
            if name in cls.__dict__:
                defaults[name] = cls.__dict__[name]
                if isinstance(defaults[name], Factory):
                    delattr(cls, name)  # no shared instance left on the class
        cls.__record_fields__ = tuple(names)
        cls.__record_defaults__ = defaults
        cls.__match_args__ = cls.__record_fields__  # type: ignore[attr-defined,misc]
        if frozen:
            cls.__setattr__ = cls.__delattr__ = _refuse  # type: ignore[assignment,method-assign]
            cls.__hash__ = Record._hash  # type: ignore[assignment,method-assign]
        else:
            cls.__hash__ = None  # type: ignore[assignment]  # mutable and compared by value

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = self.__record_fields__
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}() takes {len(names)} positional arguments "
                            f"but {len(args)} were given")
        for name, value in zip(names, args, strict=False):  # fewer: the rest by keyword
            _set(self, name, value)
        for name in names[len(args):]:
            if name in kwargs:
                _set(self, name, kwargs.pop(name))
            elif name in self.__record_defaults__:
                default = self.__record_defaults__[name]
                _set(self, name, default.make() if isinstance(default, Factory) else default)
            else:
                raise TypeError(f"{type(self).__name__}() missing argument: {name!r}")
        if kwargs:
            unknown = ", ".join(repr(k) for k in kwargs)
            raise TypeError(f"{type(self).__name__}() got unexpected or repeated arguments: "
                            f"{unknown}")

    def _values(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self.__record_fields__)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()

    def _hash(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        body = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__record_fields__)
        return f"{type(self).__qualname__}({body})"


def _refuse(self: Record, name: str, *_: object) -> None:
    raise FrozenRecordError(f"cannot assign to field {name!r} of a frozen "
                            f"{type(self).__name__}")


def fields(record: Record | type[Record]) -> tuple[str, ...]:
    """The names of a record's fields, in order (`dataclasses.fields`' names)."""
    return record.__record_fields__


def asdict(record: Record) -> dict[str, Any]:
    """Field name -> value, not copied (`dataclasses.asdict` deep-copies every value)."""
    return {name: getattr(record, name) for name in record.__record_fields__}


def replace(record: R, /, **changes: Any) -> R:
    """A copy of ``record`` with ``changes`` (`dataclasses.replace`)."""
    return type(record)(**{**asdict(record), **changes})
