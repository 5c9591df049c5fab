"""A checkpoint's index checked against its tensor files before any number in it is used.

The index (`trainer.checkpoint.pieces`) says which slices of which global tensors each tensor
file holds; a reader plans its reads (`trainer.placement.copies`) and a merge allocates whole
tensors from those numbers. `check` holds every one of them to what the files themselves say,
before anything is planned or allocated:

* every file named is a plain name in the checkpoint folder (`layout.PLAIN_NAME`) that the
  commit record lists, a regular file of the recorded size;
* every entry is well formed: its kind, a key the file's safetensors header holds (one flat
  tensor), a global name, a shape of non-negative ints, a TP cut that divides its dimension, a
  ZeRO range inside the slice;
* the entry's element count is the header's for its key: no entry claims more than its file
  holds (safetensors itself checks the header's offsets against the file's size);
* the slices of one tensor (kind, name) share its global shape and together hold exactly its
  elements (one writer per slice: they partition it).

So every count a reader plans or allocates with is bounded by bytes on disk: an entry claiming
10^12 rows is one error naming the file and the entry, not memory growing until the process is
killed. The headers are read without hashing the files (memory-mapped, a few KB each); the
files a rank then reads are verified in full (`files.verify_file`) as before.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from trainer.checkpoint.files import FileRecord, TensorFile
from trainer.checkpoint.layout import FALLBACK_HINT, PLAIN_NAME, CheckpointDamaged

KINDS = ("param", "exp_avg", "exp_avg_sq")
_MAX_DIMS = 8


def check(path: Path, index: dict[str, Any], record: dict[str, FileRecord]) -> None:
    """Refuse (`CheckpointDamaged`) an index of ``path`` that its tensor files do not back
    (module docstring)."""
    totals: dict[tuple[str, str], tuple[tuple[int, ...], int, str]] = {}
    for file, entries in index["files"].items():
        if entries is None:
            continue
        where = f"{path.name}/index.json, file {file!r}"
        if not isinstance(entries, list):
            raise _bad(path, where, "its entries are not a list")
        counts = _header(path, file, record)
        for at, entry in enumerate(entries):
            here = f"{where}, entry {at}"
            shape, numel = _entry(path, here, entry, counts)
            key = (entry["kind"], entry["name"])
            seen, held, first = totals.get(key, (shape, 0, here))
            if seen != shape:
                raise _bad(path, here, f"it gives {entry['name']} the shape {list(shape)}, "
                           f"{first} gives {list(seen)}")
            totals[key] = (shape, held + numel, first)
    for (kind, name), (shape, held, first) in totals.items():
        if held != math.prod(shape):
            raise _bad(path, first, f"the slices of {kind} {name} hold {held:,} elements, its "
                       f"shape {list(shape)} has {math.prod(shape):,}")


def _bad(path: Path, where: str, why: str) -> CheckpointDamaged:
    return CheckpointDamaged(f"checkpoint {path} is damaged", where,
                             f"its index does not match the tensor files: {why}", FALLBACK_HINT)


def _header(path: Path, file: str, record: dict[str, FileRecord]) -> dict[str, int]:
    """The element count of every key of tensor file ``file`` (each one flat tensor), from its
    safetensors header, once the name, the kind of file and its size are checked."""
    where = f"{path.name}/index.json, file {file!r}"
    if not isinstance(file, str) or not PLAIN_NAME.match(file):
        raise _bad(path, where, "the name is not a plain file name in the checkpoint folder")
    if file not in record:
        raise _bad(path, where, "the commit record does not list this file")

    def damaged(why: str) -> CheckpointDamaged:  # the file itself: said as verify_file says it
        return CheckpointDamaged(f"checkpoint {path} is damaged", f"file {file}", why,
                                 FALLBACK_HINT)

    try:
        info = os.lstat(path / file)
    except FileNotFoundError:
        raise damaged("the file is missing") from None
    except OSError as exc:
        raise damaged(f"it cannot be read: {exc.strerror or exc}") from None
    if stat.S_ISLNK(info.st_mode):
        raise damaged("it is a symbolic link, and is never followed")
    if not stat.S_ISREG(info.st_mode):
        raise damaged("it is not a regular file (a device, a pipe or a folder), and is never "
                      "read")
    if info.st_size != record[file].size:
        raise damaged(f"it has {info.st_size:,} bytes, the commit record "
                      f"{record[file].size:,} (truncated, emptied or overwritten after the "
                      "save)")
    try:
        with safe_open(str(path / file), framework="pt", device="cpu") as opened:
            shapes = {k: opened.get_slice(k).get_shape() for k in opened.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        TensorFile(path, file, record)  # says why: damaged (its checksum), or not safetensors
        raise _bad(path, where, f"its header is not safetensors ({exc})") from None
    counts = {}
    for key, shape in shapes.items():
        if len(shape) != 1:
            raise _bad(path, where, f"its tensor {key!r} has the shape {shape}, not a flat one")
        counts[key] = int(shape[0])
    return counts


def _entry(path: Path, where: str, entry: Any, counts: dict[str, int]
           ) -> tuple[tuple[int, ...], int]:
    """(global shape, elements held) of one well-formed index entry backed by its file."""
    if not (isinstance(entry, dict) and entry.get("kind") in KINDS
            and isinstance(entry.get("key"), str) and isinstance(entry.get("name"), str)):
        raise _bad(path, where, "it is not a kind, a key and a name")
    shape = entry.get("shape")
    if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS
            and all(type(n) is int and n >= 0 for n in shape)):
        raise _bad(path, where, f"its shape {shape!r} is not a list of at most {_MAX_DIMS} "
                   "non-negative ints")
    local = list(shape)
    tp, flat = entry.get("tp"), entry.get("flat")
    if tp is not None:
        if not (isinstance(tp, list) and len(tp) == 4 and all(type(n) is int for n in tp)):
            raise _bad(path, where, f"its TP cut {tp!r} is not four ints")
        dim, stride, rank, size = tp
        if not (0 <= dim < len(shape) and stride >= 1 and 0 <= rank < size
                and shape[dim] % (stride * size) == 0):
            raise _bad(path, where, f"its TP cut {tp} does not divide its shape {shape}")
        local[dim] //= size
        # The cut's runs (one per outer index and stride part) are listed: at most one per
        # element it holds.
        if math.prod(shape[:dim]) * stride > max(1, math.prod(local)):
            raise _bad(path, where, f"its TP cut {tp} of the shape {shape} holds no elements")
    numel = math.prod(local)
    if flat is not None:
        if not (isinstance(flat, list) and len(flat) == 2 and all(type(n) is int for n in flat)
                and 0 <= flat[0] <= flat[1] <= numel):
            raise _bad(path, where, f"its ZeRO range {flat!r} is not inside its {numel:,} "
                       "elements")
        numel = flat[1] - flat[0]
    if entry["key"] not in counts:
        raise _bad(path, where, f"the file holds no tensor {entry['key']!r}")
    if counts[entry["key"]] != numel:
        raise _bad(path, where, f"it claims {numel:,} elements of {entry['name']} (shape "
                   f"{shape}), the file holds {counts[entry['key']]:,}")
    return tuple(shape), numel
