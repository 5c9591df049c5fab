"""Options declared once, where they live: each field of a config dataclass carries its help
text and its bounds, and flags, TOML keys and checks are read from those declarations.

    lr: float = option(1e-3, "peak learning rate", at_least=0)

A config is a frozen dataclass whose fields are options (scalars) or *sections* (nested config
dataclasses, declared with `section`). Every option has one flag, ``--`` plus its name with
``-`` for ``_`` (a section may prefix its options' flags: ``--moe-experts``), and one TOML key,
its name in its section's table (``[moe] experts``); a section may also merge its options into
its parent's table. `options_of` lists them all, `Section.__post_init__` checks every option's
declared bounds and choices (a failure names the flag), and `build` makes the config from the
values given by name, leaving the rest at their defaults.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

from trainer.errors import ConfigError

#: A config class (a frozen dataclass of sections).
C = TypeVar("C")

SCALARS = (int, float, str, bool)


def option(default: Any, help: str, *, flag: str = "", choices: tuple[Any, ...] = (),
           at_least: float | None = None, above: float | None = None,
           below: float | None = None, at_most: float | None = None) -> Any:
    """A documented option: ``help`` is its line of ``--help``; ``flag`` replaces the name on
    the command line; ``choices`` and the bounds are checked by `Section`."""
    meta = {"help": help, "flag": flag, "choices": choices, "at_least": at_least,
            "above": above, "below": below, "at_most": at_most}
    return dataclasses.field(default=default, metadata=meta)


def section(factory: Callable[[], Any], help: str, *, table: str = "",
            merge: bool = False) -> Any:
    """A nested config. Its options go in the TOML table ``table`` (default: the field's
    name; ``merge``: the parent's table); their flags carry its class's ``flag_prefix``."""
    return dataclasses.field(default_factory=factory, metadata={
        "help": help, "section": True, "table": table, "merge": merge})


@dataclass(frozen=True)
class Option:
    """One option as users see it."""

    path: tuple[str, ...]
    """Attribute names from the root config to the option's field."""
    kind: type
    """int, float, str or bool (an optional value: its non-None type)."""
    help: str
    flag: str
    """The ``--flag`` name without dashes, underscores kept (argparse's dest)."""
    table: str
    """The TOML table ("" for the top level)."""
    key: str
    """The key inside that table."""

    @property
    def cli(self) -> str:
        return "--" + self.flag.replace("_", "-")

    @property
    def toml(self) -> str:
        return f"{self.table}.{self.key}" if self.table else self.key


def _scalar(hint: Any) -> type | None:
    if isinstance(hint, types.UnionType):
        hint = next(a for a in hint.__args__ if a is not type(None))
    return hint if hint in SCALARS else None


def options_of(cls: type, *, path: tuple[str, ...] = (), table: str = "") -> Iterator[Option]:
    """Every option of the config class ``cls`` and of its sections, in declaration order."""
    hints = typing.get_type_hints(cls)
    prefix = getattr(cls, "flag_prefix", "")
    for f in fields(cls):
        if f.metadata.get("section"):
            inner = table if f.metadata["merge"] else (f.metadata["table"] or f.name)
            yield from options_of(hints[f.name], path=(*path, f.name), table=inner)
        elif "help" in f.metadata and (kind := _scalar(hints[f.name])) is not None:
            yield Option((*path, f.name), kind, f.metadata["help"],
                         prefix + (f.metadata["flag"] or f.name), table, f.name)


class Section:
    """Base of config dataclasses: checks every option's declared bounds and choices, then
    the class's own `check` (relations between its options)."""

    flag_prefix: ClassVar[str] = ""
    """Put in front of every option's flag (``moe_``: ``--moe-experts``)."""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            meta = f.metadata
            if "help" not in meta or meta.get("section"):
                continue
            value = getattr(self, f.name)
            if meta["choices"] and value not in meta["choices"]:
                _refuse(self.flag_prefix + f.name, meta, value,
                        "must be one of " + ", ".join(str(c) for c in meta["choices"]))
            if value is None or isinstance(value, str | bool):
                continue
            if isinstance(value, float) and not math.isfinite(value):
                _refuse(self.flag_prefix + f.name, meta, value, "must be a finite number")
            for bound, ok, words in (("at_least", operator.ge, ">="), ("above", operator.gt, ">"),
                                     ("below", operator.lt, "below"),
                                     ("at_most", operator.le, "at most")):
                if meta[bound] is not None and not ok(value, meta[bound]):
                    _refuse(self.flag_prefix + f.name, meta, value,
                            f"must be {words} {_number(meta[bound])}")
        self.check()

    def check(self) -> None:
        """Relations between this section's options (none by default)."""


def _number(bound: float) -> str:
    """A bound as people write it: ``2**64`` for a large power of two, else ``%g``."""
    if isinstance(bound, int) and bound >= 2**16 and bound & (bound - 1) == 0:
        return f"2**{bound.bit_length() - 1}"
    return f"{bound:g}"


def _refuse(name: str, meta: Mapping[str, Any], value: Any, why: str) -> None:
    flag = (meta["flag"] or name).replace("_", "-")  # an explicit flag has no prefix to add
    raise ConfigError("invalid option", f"--{flag} {value}", why,
                      f"Pass a value that {why.replace('must be', 'is')}")


def build(cls: type, values: Mapping[str, Any]) -> Any:
    """``cls`` from nested ``values`` (attribute name -> value or nested mapping); what is not
    given keeps its default. A class with a ``from_values`` classmethod builds itself."""
    custom = getattr(cls, "from_values", None)
    if custom is not None:
        return custom(values)
    return build_fields(cls, values)


def build_fields(cls: type, values: Mapping[str, Any]) -> Any:
    """``cls`` from ``values`` field by field: `build` for a class without ``from_values`` (one
    with it may end there, after changing ``values``)."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        if f.metadata.get("section"):
            kwargs[f.name] = build(hints[f.name], values.get(f.name, {}))
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def nest(flat: Mapping[str, Any], options: Mapping[str, Option]) -> dict[str, Any]:
    """Values by flag name -> nested by attribute path (`build`'s input)."""
    out: dict[str, Any] = {}
    for flag, value in flat.items():
        node = out
        *parents, leaf = options[flag].path
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return out


def flatten(config: Any, options: Mapping[str, Option]) -> dict[str, Any]:
    """Every option's value by flag name (the inverse of `build` after `nest`)."""
    out = {}
    for flag, opt in options.items():
        value = config
        for name in opt.path:
            value = getattr(value, name)
        out[flag] = value
    return out


def replaced(config: C, changes: Mapping[str, Any], options: Mapping[str, Option]) -> C:
    """``config`` with the options named by flag in ``changes`` set (every section on the way
    checked again)."""
    unknown = sorted(set(changes) - set(options))
    if unknown:
        raise ConfigError("unknown option", ", ".join(unknown), "not an option of this program",
                          "Use the names of the flags, with _ for -")
    changed: C = _replace_at(config, nest(changes, options))
    return changed


def _replace_at(obj: Any, changes: Mapping[str, Any]) -> Any:
    return dataclasses.replace(obj, **{
        name: _replace_at(getattr(obj, name), value) if isinstance(value, Mapping) else value
        for name, value in changes.items()})
