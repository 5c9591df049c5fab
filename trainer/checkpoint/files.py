"""Durable, checksummed checkpoint files: safetensors and JSON, never a pickle.

Tensors are written by `safetensors` (a header of names, dtypes, shapes and offsets, then the
raw bytes): reading one back runs no code, whatever the file holds. Every file is fsynced and
hashed; its `FileRecord` (size, sha256) goes into the commit record. A reader checks the size
(a truncated or emptied file fails without being read) and then the digest before the file is
parsed, so a flipped bit or a cut-off file is refused with the file named instead of loading
garbage. A tensor file is then opened memory-mapped (`TensorFile`): a reader takes only the
ranges it needs, and a file that is not safetensors (a pickle put in its place) is one error.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from trainer.checkpoint.layout import (
    FALLBACK_HINT,
    PLAIN_NAME,
    CheckpointDamaged,
    CheckpointError,
)

_SHOWN = 12  # hex digits of a digest shown in messages
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors reports an I/O error


@dataclass(frozen=True)
class FileRecord:
    """What the commit record says about one file."""

    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256}


def write_tensors(path: Path, tensors: dict[str, torch.Tensor],
                  before_sync: Callable[[], None] = lambda: None) -> FileRecord:
    """``tensors`` (contiguous, on the CPU) as one safetensors file, fsynced, then hashed. A
    failed write raises the OSError behind it (e.g. a full disk), not safetensors' wrapper.
    ``before_sync`` runs between the write and the fsync (a fault point)."""
    try:
        save_file(tensors, str(path))
    except SafetensorError as exc:
        code = _OS_ERROR.search(str(exc))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from exc
    before_sync()
    with open(path, "rb") as fh, ThreadPoolExecutor(1) as pool:
        # The fsync waits on the disk while the hash reads the page cache: both release the
        # GIL, so they overlap; the fsync's error (EIO) is raised by result().
        synced = pool.submit(os.fsync, fh.fileno())
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
        synced.result()
    return FileRecord(path.stat().st_size, digest)


def write_bytes(path: Path, data: bytes) -> FileRecord:
    with open(path, "wb") as fh:
        fh.write(data)
        _sync(fh)
    return FileRecord(len(data), hashlib.sha256(data).hexdigest())


def _sync(fh: BinaryIO) -> None:
    fh.flush()
    os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_file(folder: Path, name: str, record: dict[str, FileRecord]) -> Path:
    """``folder/name`` if its size and sha256 match ``record``; else CheckpointDamaged."""
    path, want = folder / name, record.get(name)

    def damaged(why: str) -> CheckpointDamaged:
        return CheckpointDamaged(f"checkpoint {folder} is damaged", f"file {name}", why,
                                 FALLBACK_HINT)

    if want is None:
        raise damaged("the commit record does not list this file (a shard of another layout, "
                      "or the record was edited)")
    if not PLAIN_NAME.match(name):
        raise damaged("the name is not a plain file name in the checkpoint folder")
    try:
        # Never through a link, never blocking on a pipe; only a regular file is read.
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as fh:
            info = os.fstat(fh.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise damaged("it is not a regular file (a device, a pipe or a folder), and is "
                              "never read")
            if info.st_size != want.size:
                raise damaged(f"it has {info.st_size:,} bytes, the commit record "
                              f"{want.size:,} (truncated, emptied or overwritten after the "
                              "save)")
            got = hashlib.file_digest(fh, "sha256").hexdigest()
    except FileNotFoundError:
        raise damaged("the file is missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise damaged("it is a symbolic link, and is never followed") from None
        raise damaged(f"it cannot be read: {exc.strerror or exc}") from exc
    if got != want.sha256:
        raise damaged(f"sha256 mismatch (written {want.sha256[:_SHOWN]}..., read "
                      f"{got[:_SHOWN]}...): its bytes changed after the save")
    return path


class TensorFile:
    """A verified safetensors file, memory-mapped: ``read(key, lo, hi)`` copies out elements
    [lo, hi) of a flat tensor, nothing else. Refuses a file that is not safetensors."""

    def __init__(self, folder: Path, name: str, record: dict[str, FileRecord]) -> None:
        path = verify_file(folder, name, record)
        try:
            self._file = safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(
                "checkpoint file is not a safetensors file", str(path),
                f"{exc}: it may be a pickle or another format put in its place (its checksum "
                "matches, so whoever wrote it wrote the commit record too), and dtrain never "
                "unpickles a checkpoint", "Restore the checkpoint from a copy you trust, or "
                "start a new --run-dir") from None
        self.path = path

    def keys(self) -> list[str]:
        return list(self._file.keys())

    def read(self, key: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """Tensor ``key`` (its elements [lo, hi) when given: a flat tensor's range)."""
        if lo is None:
            return self._file.get_tensor(key)
        return self._file.get_slice(key)[lo:hi]
