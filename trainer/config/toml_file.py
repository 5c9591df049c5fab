"""The ``--config FILE`` half of the options: a TOML file read with every table, key and type
checked, so a typo never becomes a silently ignored setting.

    python -m trainer.train --config run.toml      # [model], [parallel], [optimizer], ...

Options that live in a section are written in its table (``[optimizer] lr = 3e-4``). A file
of the flat layout of earlier versions (``lr = 3e-4`` at the top, model fields under
``[gpt]``) is refused with the new place of the first key that moved.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Mapping
from typing import Any

from trainer.errors import ConfigError
from trainer.schema import Option

#: Tables of the flat layout, and where their keys went.
OLD_TABLES = {"gpt": "[model] (and the moe_ fields to [moe], without the prefix)"}


def load_toml(path: str, options: Mapping[str, Option]) -> dict[str, Any]:
    """Values by flag name from the TOML file ``path``, every key and type checked against
    ``options`` (by flag name)."""
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError("cannot read config file", path, exc.strerror or str(exc),
                          "Check the path given to --config") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config file is not valid TOML", path, str(exc),
                          "Fix the syntax at the position shown") from None
    where = {(o.table, o.key): o for o in options.values()}
    tables = {o.table for o in options.values() if o.table}
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, dict) and key in tables:
            for inner, item in value.items():
                opt = _known(where, key, inner, path, options)
                out[opt.flag] = _typed(opt, item, path)
        else:
            opt = _known(where, "", key, path, options)
            out[opt.flag] = _typed(opt, value, path)
    return out


def _known(where: Mapping[tuple[str, str], Option], table: str, key: str, path: str,
           options: Mapping[str, Option]) -> Option:
    """The option at ``table.key``, or the error naming the file, the key and the fix."""
    if (table, key) in where:
        return where[(table, key)]
    shown = f"{table}.{key}" if table else key
    if not table and key in OLD_TABLES:
        raise ConfigError("config table moved", f"{path}: [{key}]",
                          f"the [{key}] table of earlier versions is now {OLD_TABLES[key]}",
                          f"Move its keys to {OLD_TABLES[key]}")
    moved = options.get(key if not table or table in OLD_TABLES else "")
    if moved is not None and moved.table != table:
        raise ConfigError("config key moved", f"{path}: {shown}",
                          f"'{shown}' is now '{moved.toml}'",
                          f"Write it as {moved.key} under [{moved.table}]" if moved.table else
                          f"Write it as {moved.key} at the top of the file")
    known = [o.toml for o in where.values()]
    close = difflib.get_close_matches(shown, known, n=1)
    hint = f"Did you mean '{close[0]}'?" if close else f"Known keys: {', '.join(known)}"
    raise ConfigError("unknown config key", f"{path}: {shown}",
                      f"'{shown}' is not an option of the trainer", hint)


def _typed(opt: Option, value: Any, path: str) -> Any:
    kind = opt.kind
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ConfigError("invalid config value", f"{path}: {opt.toml} = {value!r}",
                          f"expected {kind.__name__}, got {type(value).__name__}",
                          f"Write {opt.toml} as a TOML {kind.__name__}")
    return value
