"""A tokenized dataset on disk (written by `trainer.data.prepare`), opened memory-mapped.

    DIR/manifest.json      what follows, with each file's size and sha256
    DIR/tokens-00000.bin   token ids, little-endian uint16 (vocabulary <= 65,536) or uint32;
    DIR/tokens-00001.bin   documents back to back, an EOS id after each
    DIR/documents.idx      uint64 offsets of every document's first token in the whole stream,
                           and the total (documents + 1 values)
    DIR/tokenizer.json     the Hugging Face ``tokenizers`` file that made the ids

Opening (`TokenFiles`) reads the manifest only: every file's size is checked against it
(``stat``), the tokenizer's vocabulary against the model's, so start-up reads no token. A
batch's windows are read with ``preadv`` straight into the rows of the batch array: the bytes
come from the kernel's page cache (shared by every rank of a host, evicted under pressure) and
nothing of the file is ever mapped into the process. A memory mapping was measured to grow a
rank's RSS by up to 2 MiB per sample read (the kernel maps the page cache's large folios whole)
until it held the dataset; reading into the batch keeps a rank's memory independent of the
dataset's size.

Checksums without reading everything at start-up: besides each file's sha256 the manifest holds
the sha256 of every ``BLOCK_BYTES`` block of a shard, and a block is verified (read with
``pread`` into a reused buffer, not through the mapping) the first time a sample touches it. A
damaged shard is refused at its first use, naming the file and block; verified blocks are
remembered, so each is hashed once per process.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from trainer.data.corpus import DataError

FORMAT = "dtrain-tokens/1"
MANIFEST, DOCUMENTS, TOKENIZER = "manifest.json", "documents.idx", "tokenizer.json"
BLOCK_BYTES = 16 * 1024 * 1024
"""Checksum granularity: a block is hashed once, at its first use (~10 ms)."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def shard_name(index: int) -> str:
    return f"tokens-{index:05d}.bin"


@dataclass(frozen=True)
class Shard:
    """One token file of a dataset, as the manifest describes it."""

    file: str
    tokens: int
    sha256: str
    blocks: tuple[str, ...]
    """sha256 of each BLOCK_BYTES block, in order (the last may be shorter)."""


@dataclass(frozen=True)
class Manifest:
    """``manifest.json``: the dataset's shape and every file's size and checksum."""

    vocab_size: int
    eos_id: int
    dtype: str
    shards: tuple[Shard, ...]
    documents: int
    files: dict[str, dict[str, Any]]
    """Every file of the dataset: {"bytes": n, "sha256": hex}."""

    def to_json(self) -> str:
        data = {"format": FORMAT, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "dtype": self.dtype, "documents": self.documents,
                "tokens": sum(s.tokens for s in self.shards), "block_bytes": BLOCK_BYTES,
                "shards": [{"file": s.file, "tokens": s.tokens, "sha256": s.sha256,
                            "blocks": list(s.blocks)} for s in self.shards],
                "files": self.files}
        return json.dumps(data, indent=1) + "\n"

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = folder / MANIFEST
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT or data.get("block_bytes") != BLOCK_BYTES:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT!r}")
            shards = tuple(Shard(s["file"], int(s["tokens"]), s["sha256"], tuple(s["blocks"]))
                           for s in data["shards"])
            return cls(int(data["vocab_size"]), int(data["eos_id"]), str(data["dtype"]), shards,
                       int(data["documents"]), dict(data["files"]))
        except OSError as err:
            raise DataError("cannot read tokenized dataset", str(path), err.strerror or str(err),
                            "Pass a folder written by python -m trainer.data.prepare") from None
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise DataError("invalid dataset manifest", str(path), f"{type(err).__name__}: {err}",
                            "Prepare the dataset again with python -m trainer.data.prepare"
                            ) from None


def damaged(path: Path, why: str) -> DataError:
    return DataError("damaged tokenized dataset", str(path), why,
                     "Prepare the dataset again (python -m trainer.data.prepare), or copy the "
                     "folder again from its source")


class TokenFiles:
    """A dataset's shards, memory-mapped, each block verified at its first use."""

    def __init__(self, folder: Path, *, model_vocab: int | None = None) -> None:
        self.folder = folder
        self.manifest = m = Manifest.read(folder)
        if model_vocab is not None and m.vocab_size > model_vocab:
            raise DataError("tokenizer does not fit the model", str(folder / MANIFEST),
                            f"its vocabulary has {m.vocab_size} ids, the model only "
                            f"{model_vocab}", f"Train with --vocab-size {m.vocab_size} or more, "
                            "or prepare the data with a smaller tokenizer")
        if np.dtype(m.dtype) != token_dtype(m.vocab_size):
            raise damaged(folder / MANIFEST, f"dtype {m.dtype} does not fit a vocabulary of "
                          f"{m.vocab_size}")
        for name, info in m.files.items():
            path = folder / name
            try:
                size = path.stat().st_size
            except OSError as err:
                raise damaged(path, f"it cannot be read ({err.strerror})") from None
            if size != info["bytes"]:
                raise damaged(path, f"it has {size} bytes, the manifest says {info['bytes']}")
        self.dtype = np.dtype(m.dtype)
        self._verified = [np.zeros(len(s.blocks), dtype=bool) for s in m.shards]
        self._buffer = bytearray(1 << 20)

    def window(self, shard: int, start: int, length: int) -> np.ndarray:
        """Tokens ``start .. start+length`` of ``shard``, verified."""
        rows: np.ndarray = self.gather(shard, np.array([start]), length)
        return cast(np.ndarray, rows[0])

    def gather(self, shard: int, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows ``starts[i] .. starts[i]+length`` of ``shard`` as one (n, length) array,
        each read straight into its row (verified)."""
        self.verify(shard, starts, length)
        rows = np.empty((len(starts), length), dtype=self.dtype)
        width = self.dtype.itemsize
        fd = os.open(self.folder / self.manifest.shards[shard].file, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for row, start in zip(rows, starts.tolist(), strict=True):
                if os.preadv(fd, [row], start * width) != row.nbytes:
                    raise damaged(self.folder / self.manifest.shards[shard].file,
                                  "it ended early (changed since it was opened)")
        finally:
            os.close(fd)
        return rows

    def verify(self, shard: int, starts: np.ndarray, length: int) -> None:
        """Verify the blocks the rows ``starts[i] .. starts[i]+length`` touch that are not
        verified yet."""
        width = self.dtype.itemsize
        first, last = starts * width // BLOCK_BYTES, ((starts + length) * width - 1) // BLOCK_BYTES
        done = self._verified[shard]
        if done[first].all() and done[last].all():
            return
        for block in np.unique(np.concatenate([first, last])):
            if not done[block]:
                self._verify(shard, int(block))

    def _verify(self, shard: int, block: int) -> None:
        info = self.manifest.shards[shard]
        path = self.folder / info.file
        digest, buf = hashlib.sha256(), memoryview(self._buffer)
        with open(path, "rb", buffering=0) as f:
            f.seek(block * BLOCK_BYTES)
            left = BLOCK_BYTES
            while left and (n := f.readinto(buf[:min(left, len(buf))])):
                digest.update(buf[:n])
                left -= n
        if digest.hexdigest() != info.blocks[block]:
            raise damaged(path, f"block {block} (bytes {block * BLOCK_BYTES}..) does not match "
                          "its sha256 in the manifest")
        self._verified[shard][block] = True

    def documents(self) -> np.ndarray:
        """The document offsets (memory-mapped uint64, documents + 1 values)."""
        return np.memmap(self.folder / DOCUMENTS, dtype="<u8", mode="r")


def file_sha256(path: Path) -> str:
    """sha256 of a whole file, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
