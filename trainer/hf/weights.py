"""Safetensors weights in Hugging Face's layout: written in shards with an index, read by slice.

Writing (`write_weights`): the tensors are planned into shards of at most ``max_shard_bytes``
from their sizes alone (Hugging Face's rule: a tensor larger than the limit gets a shard of its
own). Each file is then streamed one tensor at a time (`write_streamed`): its header is
written from the shapes alone, then every tensor is fetched, its bytes written and the tensor
dropped before the next is fetched, so an export holds one tensor at a time, whatever the
shard size. safetensors' own writers (``save_file``, ``serialize``) take every tensor of a
file at once; the format (an 8-byte little-endian header length, a JSON header of dtype,
shape and byte range per tensor, then the raw little-endian bytes) is written here for that
reason only, and read back by safetensors and transformers in the tests. One shard is
``model.safetensors``; more are ``model-00001-of-0000N.safetensors`` plus
``model.safetensors.index.json`` (``weight_map``: tensor -> file), what ``from_pretrained``
reads.

Reading (`HFWeights`): the index (or the single file's header) says which file holds each
tensor; `HFWeights.rows` reads only the requested row or column ranges of a dtrain parameter
through safetensors' lazy slices (the file is memory-mapped, only the touched pages are read),
so a tensor-parallel rank never holds a tensor it does not own beyond one piece.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from trainer.hf.config import HFError
from trainer.hf.names import pieces
from trainer.model.config import GPTConfig

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 1000**3
"""Hugging Face's default ``max_shard_size`` of ``save_pretrained`` (5 GB)."""
_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.float64: "F64"}
"""safetensors' names of the dtypes an export writes."""


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Names grouped into consecutive shards of at most ``max_bytes`` (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_weights(out: Path, entries: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                  fetch: Callable[[str], torch.Tensor],
                  max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Write the tensors of ``entries`` (name, shape; all of ``dtype``) into ``out``;
    ``fetch(name)`` gives one tensor, asked for once, in the order of ``entries``. Returns
    the files written."""
    shape_of = dict(entries)
    plan = plan_shards([(name, math.prod(shape) * dtype.itemsize) for name, shape in entries],
                       max_shard_bytes)
    files = [SINGLE] if len(plan) == 1 else [
        f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan))]
    weight_map: dict[str, str] = {}
    for names, file in zip(plan, files, strict=True):
        write_streamed(out / file, [(name, shape_of[name]) for name in names], dtype, fetch)
        weight_map.update(dict.fromkeys(names, file))
    if len(plan) > 1:
        total = sum(math.prod(shape) for _, shape in entries) * dtype.itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files


def write_streamed(path: Path, entries: list[tuple[str, tuple[int, ...]]],
                   dtype: torch.dtype, fetch: Callable[[str], torch.Tensor]) -> None:
    """One safetensors file of ``entries`` (name, shape), the header first, then each tensor
    fetched, written and dropped in turn (module docstring)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, shape in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape),
                        "data_offsets": [at, at + size]}
        at += size
    if sys.byteorder != "little":
        raise HFError("cannot write safetensors here", f"{sys.byteorder}-endian host",
                      "safetensors holds little-endian bytes and tensors are written as held",
                      "Export on a little-endian machine (x86-64, ARM)")
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape in entries:
            tensor = fetch(name)
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise RuntimeError(f"{name}: fetched {tuple(tensor.shape)} {tensor.dtype}, "
                                   f"planned {shape} {dtype}")  # a wiring bug
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del tensor


class HFWeights:
    """The safetensors weights of a Hugging Face folder, read tensor by tensor or by slice."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._open: dict[str, Any] = {}
        index = folder / INDEX
        if index.is_file():
            try:
                self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise HFError("unreadable weight index", str(index), str(err),
                              "Re-save the folder with save_pretrained") from None
        elif (folder / SINGLE).is_file():
            self.weight_map = dict.fromkeys(self._opened(SINGLE).keys(), SINGLE)
        else:
            raise HFError("no safetensors weights", str(folder),
                          f"neither {SINGLE} nor {INDEX} is there (PyTorch .bin files are "
                          "not read: unpickling runs code)",
                          "Save the model with save_pretrained(safe_serialization=True)")
        # Every file's header is read now (a few KB each, memory-mapped): a broken or
        # missing shard is one error naming it, at start-up on every rank alike, not a
        # safetensors traceback on the ranks that reach it.
        if not isinstance(self.weight_map, dict):
            raise HFError("unreadable weight index", str(index), "its weight_map is not an "
                          "object", "Re-save the folder with save_pretrained")
        for name, file in self.weight_map.items():
            if not isinstance(file, str) or os.sep in file or file.startswith(".."):
                raise HFError("weight index names a file outside the folder", str(index),
                              f"{name} -> {file}", "Use an index written by save_pretrained")
        for file in sorted(set(self.weight_map.values())):
            self._opened(file)

    def _opened(self, file: str) -> Any:
        """The open safetensors file ``file`` of the folder (opened once)."""
        if file not in self._open:
            path = self.folder / file
            try:
                self._open[file] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, ValueError) as err:
                raise HFError("unreadable Hugging Face weights", str(path),
                              f"{err} (a download cut short, or not a safetensors file)",
                              "Download or save the folder again (save_pretrained)") from None
        return self._open[file]

    def _handle(self, name: str) -> Any:
        file = self.weight_map.get(name)
        if file is None:
            raise HFError("tensor missing from Hugging Face weights", str(self.folder),
                          f"{name} is in no file of the folder",
                          "Check that the folder holds the whole model")
        return self._opened(file)

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """Tensor ``name``, or its part ``index`` (slices), read lazily."""
        part = self._handle(name).get_slice(name)
        tensor: torch.Tensor = part[index] if index else part[:]
        return tensor

    def rows(self, param: str, cfg: GPTConfig, dim: int,
             ranges: list[tuple[int, int]]) -> torch.Tensor:
        """The part of dtrain parameter ``param`` made of ``ranges`` (ascending (start, stop)
        along ``dim``), concatenated in order; rows past the real vocabulary are zeros."""
        out = []
        offset = 0
        for hf, shape in pieces(param, cfg):
            self._check_shape(hf, shape)
            for start, stop in ranges:
                if dim == 0:
                    lo, hi = max(start, offset), min(stop, offset + shape[0])
                    if lo < hi:
                        out.append(self.read(hf, (slice(lo - offset, hi - offset),)))
                else:
                    out.append(self.read(hf, (slice(None), slice(start, stop))))
            offset += shape[0]
        pad = sum(max(0, stop - max(start, offset)) for start, stop in ranges) if dim == 0 else 0
        if pad:  # padded vocabulary rows, after the real ones
            dtype = self.read(hf, (slice(0, 0),)).dtype
            out.append(torch.zeros(pad, *shape[1:], dtype=dtype))
        return torch.cat(out, dim=dim)

    def _check_shape(self, hf: str, want: tuple[int, ...]) -> None:
        shape = tuple(self.shape(hf))
        if shape != want:
            raise HFError("Hugging Face tensor of the wrong shape", f"{self.folder}: {hf}",
                          f"it is {list(shape)}, the config says {list(want)}",
                          "Use the config.json saved with these weights")
