"""The checksums of checkpoint files, by commit-record format: XXH3-128 from format 4, sha256 in
format 3 (still verified, so checkpoints written before the change load).

Why XXH3-128 (the ``xxhash`` package, a binding of the reference xxHash library): a checkpoint
writer must hash every byte it writes, on the cores the training uses. sha256 runs at 1-2 GB/s
per core, slower than a disk, and cost a second read of the file; XXH3 runs at tens of GB/s
(measured here: 22 GB/s against sha256's 1.8), so it is computed on each chunk in the same pass
as the write, from the cache, and releases the GIL while it runs. What it detects:

* random damage (a flipped bit, a torn or zeroed sector, a stale page): a 128-bit digest with
  full avalanche misses one with probability about 2^-128. CRC32C (the other fast candidate,
  11.8 GB/s here) guarantees every burst of up to 32 bits but lets through 2^-32 of longer
  damage, a whole zeroed page for example: too weak for many multi-GB files over a run's life;
* a file swapped for another checkpoint's file, or for an edited copy: a size or digest
  mismatch, since no two files of different content share a digest in practice (collisions
  of XXH3-128 among 2^40 files: about 2^-48).

Neither it nor sha256 here is a defence against someone who can write the folder: whoever can
replace a file can rewrite the commit record beside it. The reader never unpickles, whatever
the files hold (`trainer.checkpoint.files`).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import xxhash

#: The checksum a commit record of each format names for every file.
BY_FORMAT = {3: "sha256", 4: "xxh3_128"}
#: What this dtrain writes.
WRITTEN = "xxh3_128"
#: Hex digits of each checksum.
HEX_DIGITS = {"sha256": 64, "xxh3_128": 32}
CHUNK = 8 << 20
"""Bytes hashed (and written) at a time: large enough for the disk and to release the GIL
for a long stretch, small enough to stay in the cache between the hash and the write."""


class Digest(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


_NEW: dict[str, Callable[[], Digest]] = {"sha256": hashlib.sha256, "xxh3_128": xxhash.xxh3_128}


def new(algorithm: str = WRITTEN) -> Digest:
    """An empty running checksum of ``algorithm``."""
    return _NEW[algorithm]()


def of_file(path: Path, algorithm: str) -> str:
    """The hex checksum of the file at ``path``."""
    with open(path, "rb") as fh:
        return of_stream(fh, algorithm)


def of_stream(fh: io.BufferedIOBase, algorithm: str) -> str:
    """The hex checksum of an open file from its position on: read in `CHUNK`s into one
    reused buffer."""
    digest, buffer = new(algorithm), bytearray(CHUNK)
    view = memoryview(buffer)
    while n := fh.readinto(buffer):
        digest.update(view[:n])
    return digest.hexdigest()
