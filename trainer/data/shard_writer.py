"""Write token shards, the document index and their checksums as the ids arrive.

Each document's ids (EOS included) are appended to the current shard, which is closed at
``shard_tokens`` tokens (a document may continue in the next shard: samples are cut from the
token stream, not from documents). Every byte is hashed as it is written, into the file's
sha256 and its current block's (`trainer.data.token_files.BLOCK_BYTES`), so nothing is read
back. The document offsets go to ``documents.idx`` as they come, so memory does not grow with
the corpus either.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO

import numpy as np

from trainer.data.token_files import BLOCK_BYTES, DOCUMENTS, Shard, shard_name


class _HashedFile:
    """A file being written, with its sha256 and the sha256 of each block."""

    def __init__(self, path: Path) -> None:
        self.f: BinaryIO = open(path, "wb")  # noqa: SIM115 (closed in close())
        self.whole, self.block = hashlib.sha256(), hashlib.sha256()
        self.in_block, self.size = 0, 0
        self.blocks: list[str] = []

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.f.write(view)
        self.whole.update(view)
        self.size += len(view)
        while len(view):
            take = min(len(view), BLOCK_BYTES - self.in_block)
            self.block.update(view[:take])
            self.in_block += take
            view = view[take:]
            if self.in_block == BLOCK_BYTES:
                self._end_block()

    def _end_block(self) -> None:
        self.blocks.append(self.block.hexdigest())
        self.block, self.in_block = hashlib.sha256(), 0

    def close(self) -> None:
        if self.in_block:
            self._end_block()
        self.f.close()


class ShardWriter:
    """Token shards of at most ``shard_tokens`` ids of ``dtype`` in ``folder``."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int) -> None:
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.shards: list[Shard] = []
        self.files: dict[str, dict[str, object]] = {}
        self.tokens = self.documents = 0
        self._current: _HashedFile | None = None
        self._in_shard = 0
        self._index = _HashedFile(folder / DOCUMENTS)
        self._offsets: list[int] = []

    def add(self, ids: np.ndarray) -> None:
        """Append one document (its ids, EOS included)."""
        self._offsets.append(self.tokens)
        if len(self._offsets) >= 1 << 16:
            self._flush_offsets()
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if self._current is None:
                self._current = _HashedFile(self.folder / shard_name(len(self.shards)))
            take = min(len(ids), self.shard_tokens - self._in_shard)
            self._current.write(ids[:take].tobytes())
            self._in_shard += take
            self.tokens += take
            ids = ids[take:]
            if self._in_shard == self.shard_tokens:
                self._end_shard()
        self.documents += 1

    def _flush_offsets(self) -> None:
        self._index.write(np.asarray(self._offsets, dtype="<u8").tobytes())
        self._offsets.clear()

    def _end_shard(self) -> None:
        assert self._current is not None
        self._current.close()
        name = shard_name(len(self.shards))
        self.shards.append(Shard(name, self._in_shard, self._current.whole.hexdigest(),
                                 tuple(self._current.blocks)))
        self.files[name] = {"bytes": self._current.size, "sha256": self.shards[-1].sha256}
        self._current, self._in_shard = None, 0

    def close(self) -> None:
        """Finish the last shard and the document index (the total as its last offset)."""
        if self._current is not None:
            self._end_shard()
        self._offsets.append(self.tokens)
        self._flush_offsets()
        self._index.close()
        self.files[DOCUMENTS] = {"bytes": self._index.size,
                                 "sha256": self._index.whole.hexdigest()}
