"""A packed tokenized dataset of short documents, written straight into the on-disk format
(`trainer.data.token_files`), for the document-masking tests.

Document lengths are drawn from a seeded generator between `SHORTEST` and `LONGEST` tokens
(the EOS included), so a window of 32 tokens holds several documents and some boundaries fall
on the edges of context-parallel chunks; the ids are random below `VOCAB`, EOS is id 0. The
tokenizer file is a word-level vocabulary of the same ids, saved by the ``tokenizers`` library
(deterministic), so two processes that call `write_documents` write identical datasets.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, models

from trainer.data.shard_writer import ShardWriter
from trainer.data.token_files import MANIFEST, TOKENIZER, Manifest, file_sha256, token_dtype

VOCAB = 256
"""The byte-level presets' vocabulary (``tiny``, ``llama-tiny``)."""
EOS = 0
SHORTEST, LONGEST = 2, 14


def write_documents(folder: Path, tokens: int, *, seed: int = 0) -> Path:
    """About ``tokens`` ids of documents of SHORTEST..LONGEST tokens each, in ``folder``."""
    folder.mkdir(parents=True)
    writer = ShardWriter(folder, token_dtype(VOCAB), 1 << 20)
    rng = np.random.default_rng(seed)
    written = 0
    while written < tokens:
        body = rng.integers(1, VOCAB, int(rng.integers(SHORTEST, LONGEST + 1)) - 1)
        writer.add(np.append(body, EOS))
        written += len(body) + 1
    writer.close()
    vocab = {"<|endoftext|>": EOS, **{f"t{i}": i for i in range(1, VOCAB)}}
    Tokenizer(models.WordLevel(vocab, unk_token="t1")).save(str(folder / TOKENIZER))
    writer.files[TOKENIZER] = {"bytes": (folder / TOKENIZER).stat().st_size,
                               "sha256": file_sha256(folder / TOKENIZER)}
    (folder / MANIFEST).write_text(Manifest(VOCAB, EOS, token_dtype(VOCAB).str,
                                            tuple(writer.shards), writer.documents,
                                            writer.files).to_json())
    return folder
