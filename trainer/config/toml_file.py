"""The ``--config FILE`` half of `trainer.config.options`: a TOML file read with every key and type
checked, so a typo never becomes a silently ignored setting.

    python -m trainer.train --config run.toml        # model fields go in a [gpt] table
"""

from __future__ import annotations

import difflib
import tomllib
from typing import Any

from trainer.errors import ConfigError


def load_toml(path: str, train_types: dict[str, type], gpt_types: dict[str, type]
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(train options, gpt overrides) from a TOML file, every key and type checked against the
    scalar field types of the train and the gpt config."""
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError("cannot read config file", path, exc.strerror or str(exc),
                          "Check the path given to --config") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config file is not valid TOML", path, str(exc),
                          "Fix the syntax at the position shown") from None
    gpt = doc.pop("gpt", {})
    if not isinstance(gpt, dict):
        raise ConfigError("invalid config value", f"{path}: gpt", "gpt must be a table",
                          "Write model fields under a [gpt] header")
    return _checked(doc, train_types, path, ""), _checked(gpt, gpt_types, path, "gpt.")


def _checked(table: dict[str, Any], schema: dict[str, type], path: str, prefix: str
             ) -> dict[str, Any]:
    for key, value in table.items():
        if key not in schema:
            close = difflib.get_close_matches(key, schema, n=1)
            hint = f"Did you mean '{prefix}{close[0]}'?" if close else \
                f"Known keys: {', '.join(prefix + k for k in schema)}"
            raise ConfigError("unknown config key", f"{path}: {prefix}{key}",
                              f"'{prefix}{key}' is not an option of the trainer", hint)
        kind = schema[key]
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConfigError("invalid config value", f"{path}: {prefix}{key} = {value!r}",
                              f"expected {kind.__name__}, got {type(value).__name__}",
                              f"Write {prefix}{key} as a TOML {kind.__name__}")
        table[key] = value
    return table
