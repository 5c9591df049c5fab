"""What ``--data`` names: byte-level text (a file or folder), or tokenized datasets, blended.

    --data corpus.txt              text, byte-level (`trainer.data.corpus`)
    --data data/web                a folder written by `trainer.data.prepare` (it has a manifest)
    --data data/web:0.7,data/code:0.3
                                   tokenized datasets blended by weight (`token_batches`)

An item is ``PATH`` or ``PATH:WEIGHT`` (a path whose last ``:`` part is not a number is taken
whole); weights are relative (normalised to sum to 1). Blending and weights need tokenized
datasets: every item must be one, and text is a single path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from trainer.data.corpus import DataError
from trainer.data.token_files import MANIFEST


@dataclass(frozen=True)
class DataSources:
    """Parsed ``--data``: either tokenized datasets with weights, or a text path (or none:
    the default corpus)."""

    tokenized: tuple[tuple[Path, float], ...] = ()
    text: str | None = None


def _item(item: str, where: str) -> tuple[Path, float | None]:
    path, colon, weight = item.rpartition(":")
    if not colon or not path:
        return Path(item), None
    try:
        value = float(weight)
    except ValueError:
        return Path(item), None  # a ':' inside the path itself
    if not (math.isfinite(value) and value > 0):
        raise DataError("invalid dataset weight", where, f"{item}: the weight must be a "
                        "positive number", "Write each blended dataset as PATH:WEIGHT, "
                        "e.g. data/web:0.7,data/code:0.3")
    return Path(path), value


def parse_data(value: str | None) -> DataSources:
    """Read ``--data``; tokenized folders are recognised by their manifest."""
    if not value:
        return DataSources()
    where = f"--data {value}"
    items = [_item(part, where) for part in value.split(",") if part]
    tokenized = [(path, weight) for path, weight in items if (path / MANIFEST).is_file()]
    if len(items) == 1 and not tokenized and items[0][1] is None:
        return DataSources(text=str(items[0][0]))
    if len(tokenized) < len(items):
        bad = next(str(path) for path, _ in items if not (path / MANIFEST).is_file())
        raise DataError("not a tokenized dataset", f"{where}: {bad}",
                        f"there is no {MANIFEST} in it; blends and weights need datasets "
                        "written by python -m trainer.data.prepare",
                        "Prepare the text with python -m trainer.data.prepare, or pass one "
                        "text file or folder without a weight")
    return DataSources(tokenized=tuple((path, weight or 1.0) for path, weight in tokenized))
