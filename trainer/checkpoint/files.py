"""Durable, checksummed checkpoint files: hashed while written, verified before read back.

Every file is written through a sha256 hasher (no second read of what was just written) and
fsynced; its `FileRecord` (size, digest) goes into the commit record. A reader checks the size
(a truncated or emptied file fails without being read) and then the digest before the file is
parsed, so a flipped bit or a cut-off shard is refused with the file named instead of loading
garbage or failing deep inside the unpickler.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from trainer.checkpoint.layout import FALLBACK_HINT, CheckpointDamaged

_SHOWN = 12  # hex digits of a digest shown in messages


@dataclass(frozen=True)
class FileRecord:
    """What the commit record says about one file."""

    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256}


class _HashingWriter:
    """The file object handed to ``torch.save``: counts and hashes every byte it passes on."""

    def __init__(self, fh: BinaryIO) -> None:
        self._fh, self.hash, self.size = fh, hashlib.sha256(), 0
        self.error: OSError | None = None
        """The OSError of a failed write (e.g. a full disk), whatever torch raises for it."""

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        self.size += len(data)
        try:
            return self._fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._fh.flush()


def write_torch(path: Path, obj: Any) -> FileRecord:
    with open(path, "wb") as fh:
        writer = _HashingWriter(fh)
        try:
            torch.save(obj, writer)
        except Exception as exc:
            if writer.error is not None and writer.error is not exc:
                raise writer.error from exc  # the disk's error, not torch's wrapper of it
            raise
        _sync(fh)
    return FileRecord(writer.size, writer.hash.hexdigest())


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
    try:
        size = path.stat().st_size
        if size != want.size:
            raise damaged(f"it has {size:,} bytes, the commit record {want.size:,} (truncated, "
                          "emptied or overwritten after the save)")
        with open(path, "rb") as fh:
            got = hashlib.file_digest(fh, "sha256").hexdigest()
    except FileNotFoundError:
        raise damaged("the file is missing") from None
    except OSError as exc:
        raise damaged(f"it cannot be read: {exc.strerror or exc}") from exc
    if got != want.sha256:
        raise damaged(f"sha256 mismatch (written {want.sha256[:_SHOWN]}..., read "
                      f"{got[:_SHOWN]}...): its bytes changed after the save")
    return path
