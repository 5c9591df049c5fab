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

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from trainer.data.batches import BatchPlan, Keep, ShardedBatches, check_splits
from trainer.data.corpus import Corpus, DataError, check_vocab, load_corpus
from trainer.data.token_batches import (
    Source,
    TokenBatches,
    check_document_ends,
    check_same_tokenizer,
)
from trainer.data.token_files import MANIFEST, TOKENIZER, Manifest, TokenFiles


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


@dataclass(frozen=True)
class TokenData:
    """Tokenized training data, checked and described like a `Corpus` (its manifests read,
    every file's size checked; no token read)."""

    blend: tuple[tuple[Path, float], ...]
    val_fraction: float
    model_vocab: int
    tokens: int
    fingerprint: str
    """sha256 of the manifests and weights, shortened as a `Corpus` fingerprint is."""
    unit: ClassVar[str] = "tokens"
    binary_files: ClassVar[tuple[str, ...]] = ()
    skipped: ClassVar[tuple[str, ...]] = ()

    @property
    def source(self) -> str:
        return ",".join(f"{path}:{weight:g}" for path, weight in self.blend)

    @property
    def tokenizer(self) -> Path:
        """The ``tokenizer.json`` that made the ids (the same for every blended dataset)."""
        return self.blend[0][0] / TOKENIZER

    def __len__(self) -> int:
        return self.tokens


def load_token_data(sources: DataSources, *, model_vocab: int, seq_len: int,
                    val_fraction: float, documents: bool = False) -> TokenData:
    """Open and check the tokenized datasets of ``sources`` for a model of ``model_vocab``
    ids: sizes, vocabulary, tokenizers, splits large enough for one window each, and with
    ``documents`` (``--document-mask``) one EOS id that ends their documents."""
    files = [TokenFiles(path, model_vocab=model_vocab) for path, _ in sources.tokenized]
    check_same_tokenizer(files)
    if documents:
        check_document_ends(files)
    for data in files:
        Source(data, seq_len, val_fraction)  # refuses splits too small for a window
    digest = hashlib.sha256()
    for path, weight in sources.tokenized:
        digest.update((path / MANIFEST).read_bytes() + f"{weight!r}".encode())
    tokens = sum(s.tokens for data in files for s in data.manifest.shards)
    return TokenData(sources.tokenized, val_fraction, model_vocab, tokens,
                     digest.hexdigest()[:16])


def read_data(path: str | None, *, vocab_size: int, seq_len: int, val_fraction: float,
              documents: bool, cap_mb: float, validation: bool) -> Corpus | TokenData:
    """A run's data (``--data`` ``path``: text, or tokenized datasets), refused when the model
    (``vocab_size``, ``seq_len``) or the splits cannot use it (``validation``: the run
    evaluates). `trainer.training.startup.training_data` reads the run's with it."""
    sources = parse_data(path)
    if sources.tokenized:
        return load_token_data(sources, model_vocab=vocab_size, seq_len=seq_len,
                               val_fraction=val_fraction, documents=documents)
    check_document_mask(documents, sources.text or "(the default corpus)")
    corpus = load_corpus(sources.text, cap_bytes=int(cap_mb * 2**20), val_fraction=val_fraction)
    check_vocab(corpus, vocab_size)
    check_splits(corpus, seq_len, validation=validation)
    return corpus


def make_batches(data: Corpus | TokenData, *, seq_len: int, plan: BatchPlan, seed: int,
                 dp_rank: int, device: torch.device, validation: bool = False,
                 reporter: bool = True, keep: Keep | None = None, documents: bool = False
                 ) -> ShardedBatches | TokenBatches:
    """The batches of one DP rank from either kind of data (both answer ``microbatches(step)``
    with the same plan, seed and device); ``reporter``: this rank prints an error every rank
    meets together (a damaged block of a tokenized dataset); ``keep``: the part of every
    window this rank trains on (`trainer.data.batches.Keep`: a cp rank's chunks);
    ``documents``: each microbatch carries its document ids (``--document-mask``: tokenized
    data only, `check_document_mask`)."""
    if isinstance(data, TokenData):
        return TokenBatches(list(data.blend), seq_len=seq_len, plan=plan, seed=seed,
                            dp_rank=dp_rank, model_vocab=data.model_vocab,
                            val_fraction=data.val_fraction, device=device,
                            validation=validation, reporter=reporter, keep=keep,
                            documents=documents)
    check_document_mask(documents, data.source)
    return ShardedBatches(data, seq_len=seq_len, plan=plan, seed=seed, dp_rank=dp_rank,
                          device=device, validation=validation, keep=keep)


def check_document_mask(documents: bool, text: str) -> None:
    """Refuse ``--document-mask`` on byte-level text: it has no end-of-document token."""
    if documents:
        raise DataError("document masking needs an end-of-document token",
                        f"--document-mask --data {text}", "byte-level text has no token that "
                        "ends a document, so the documents inside a window cannot be told apart",
                        "Prepare the text with python -m trainer.data.prepare (it ends every "
                        "document with the tokenizer's EOS id and --data takes the folder), or "
                        "drop --document-mask")


def data_vocab(sources: DataSources) -> int | None:
    """The vocabulary of the tokenized datasets of ``sources`` (their manifests' largest: one
    tokenizer made them all, `check_same_tokenizer`); None for text."""
    sizes = [Manifest.read(path).vocab_size for path, _ in sources.tokenized]
    return max(sizes) if sizes else None


def keep_tokenizer(data: TokenData, run_dir: Path) -> Path:
    """Copy the data's tokenizer into ``run_dir`` (replaced atomically: a resumed run on the
    same data writes the same file), where generation and export find it."""
    target = run_dir / TOKENIZER
    tmp = run_dir / f".{TOKENIZER}.tmp"
    tmp.write_bytes(data.tokenizer.read_bytes())
    os.replace(tmp, target)
    return target
