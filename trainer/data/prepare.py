"""``python -m trainer.data.prepare``: tokenize text files into a dataset `--data` trains on.

    python -m trainer.data.prepare --input docs/*.txt --out data/docs --train-bpe 8192
    python -m trainer.data.prepare --input corpus.jsonl --out data/c --tokenizer tokenizer.json

Documents: a ``.jsonl`` file holds one per line (its ``"text"``), any other file is one
document. Each document's ids are followed by the EOS id (``--eos``, else the tokenizer's
``<|endoftext|>``, ``<|end_of_text|>``, ``</s>`` or ``<eos>``). The tokenizer is a local
Hugging Face ``tokenizers`` file, or a byte-level BPE trained on the inputs (``--train-bpe
VOCAB``); nothing is ever downloaded. Encoding runs in batches through ``encode_batch_fast``,
which spreads each batch over every core (the library's own thread pool), with a progress bar
of the bytes read. The dataset is written into a temporary folder beside ``--out`` and renamed
into place when complete, so a failed run leaves nothing behind and an existing folder is never
touched. Its layout: `trainer.data.token_files`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TransferSpeedColumn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trainer.data.corpus import DataError
from trainer.data.shard_writer import ShardWriter
from trainer.data.token_files import MANIFEST, TOKENIZER, Manifest, file_sha256, token_dtype
from workerenv import DtrainError

EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
DEFAULT_SHARD_TOKENS = 1 << 27
"""Tokens per shard: 256 MiB of uint16."""
BATCH_BYTES = 4 << 20
"""Text handed to one encode_batch_fast call (enough to keep every core busy)."""


def _decode(raw: bytes, where: Path, first_line: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + raw[:err.start].count(b"\n")
        raise DataError("input is not UTF-8 text", f"{where}:{line}", str(err),
                        "Convert the file to UTF-8, or leave it out") from None


def documents(path: Path) -> Iterator[tuple[str, int]]:
    """(text, bytes read) of every document of one input file; a ``.jsonl`` file is streamed
    line by line, any other file is read whole (it is one document)."""
    try:
        with open(path, "rb") as f:
            if path.suffix != ".jsonl":
                raw = f.read()
                yield _decode(raw, path, 1), len(raw)
                return
            for number, raw in enumerate(f, 1):
                if raw.strip():
                    yield _jsonl_text(_decode(raw, path, number), f"{path}:{number}"), len(raw)
    except OSError as err:
        raise DataError("cannot read input", str(path), err.strerror or str(err),
                        "Check the path and its permissions") from None


def _jsonl_text(line: str, where: str) -> str:
    try:
        doc = json.loads(line)["text"]
    except (ValueError, KeyError, TypeError):
        raise DataError("invalid JSON lines input", where, 'each line must be an object with '
                        'a "text" string', "Fix the line, or pass plain text files") from None
    if not isinstance(doc, str):
        raise DataError("invalid JSON lines input", where, '"text" is not a string',
                        "Fix the line")
    return doc


def train_bpe(files: Sequence[Path], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2's scheme) trained on ``files``, EOS ``<|endoftext|>``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_NAMES[0]],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator((text for path in files for text, _ in documents(path)), trainer)
    return tok


def load_tokenizer(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # the library raises plain Exception for a bad file
        raise DataError("cannot load tokenizer", str(path), str(err).splitlines()[0],
                        "Pass a tokenizer.json saved by Hugging Face tokenizers") from None


def eos_id(tok: Tokenizer, name: str | None, where: str) -> int:
    for candidate in [name] if name else EOS_NAMES:
        found = tok.token_to_id(candidate)
        if found is not None:
            return int(found)
    raise DataError("no end-of-document token", where,
                    f"the tokenizer has none of {', '.join([name] if name else EOS_NAMES)}",
                    "Name its EOS token with --eos TOKEN")


def encode_into(writer: ShardWriter, tok: Tokenizer, files: Sequence[Path], eos: int,
                progress: Progress) -> None:
    """Encode every document of ``files`` in batches and append it to ``writer``."""
    task = progress.add_task("tokenizing", total=sum(p.stat().st_size for p in files))
    batch: list[str] = []
    size = 0

    def flush() -> None:
        nonlocal size
        for enc in tok.encode_batch_fast(batch, add_special_tokens=False):
            writer.add(np.append(np.asarray(enc.ids, dtype=np.int64), eos))
        progress.advance(task, size)
        batch.clear()
        size = 0

    for path in files:
        for text, read in documents(path):
            batch.append(text)
            size += read
            if size >= BATCH_BYTES:
                flush()
    flush()


def prepare(files: Sequence[Path], out: Path, *, tokenizer: Path | None = None,
            train_vocab: int = 0, eos: str | None = None,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, quiet: bool = False) -> Manifest:
    """Tokenize ``files`` into the new dataset folder ``out`` and return its manifest."""
    for path in files:
        if not path.is_file():
            raise DataError("input is not a file", str(path), "it does not exist or is a "
                            "folder, FIFO or device", "Pass regular text files with --input")
    if out.exists():
        raise DataError("output folder exists", str(out), "it would be overwritten",
                        "Pass a new --out, or remove the old folder first")
    tok = load_tokenizer(tokenizer) if tokenizer else train_bpe(files, train_vocab)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos_token = eos_id(tok, eos, str(tokenizer or "--train-bpe"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        writer = ShardWriter(tmp, token_dtype(vocab), shard_tokens)
        columns = (TextColumn("{task.description}"), BarColumn(), TransferSpeedColumn())
        with Progress(*columns, disable=quiet, transient=True) as progress:
            encode_into(writer, tok, files, eos_token, progress)
        writer.close()
        if writer.tokens == writer.documents:  # nothing but the EOS after each document
            shown = ", ".join(map(str, files[:3])) + \
                (f" and {len(files) - 3} more" if len(files) > 3 else "")
            raise DataError("no text to tokenize", shown,
                            f"the {len(files)} input file(s) hold no text (empty files or "
                            "documents), so the dataset would hold no training window",
                            "Pass files with text in them")
        tok.save(str(tmp / TOKENIZER))
        writer.files[TOKENIZER] = {"bytes": (tmp / TOKENIZER).stat().st_size,
                                   "sha256": file_sha256(tmp / TOKENIZER)}
        manifest = Manifest(vocab, eos_token, token_dtype(vocab).str, tuple(writer.shards),
                            writer.documents, writer.files)
        (tmp / MANIFEST).write_text(manifest.to_json())
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the dataset from the ranks' users
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.data.prepare",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", type=Path, required=True,
                        help="text files (.jsonl: one document per line's \"text\")")
    parser.add_argument("--out", type=Path, required=True, help="the new dataset folder")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokenizer", type=Path, help="a local tokenizer.json")
    which.add_argument("--train-bpe", type=int, metavar="VOCAB",
                       help="train a byte-level BPE of this vocabulary size on the inputs")
    parser.add_argument("--eos", help="the end-of-document token (default: found by name)")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                        help="tokens per shard file")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.train_bpe is not None and args.train_bpe < 257:
        parser.error("--train-bpe needs a vocabulary of at least 257 (256 bytes and EOS)")
    if args.shard_tokens < 1:
        parser.error("--shard-tokens must be >= 1")
    try:
        m = prepare(args.input, args.out, tokenizer=args.tokenizer,
                    train_vocab=args.train_bpe or 0, eos=args.eos,
                    shard_tokens=args.shard_tokens, quiet=args.quiet)
    except DtrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    tokens = sum(s.tokens for s in m.shards)
    print(f"{args.out}: {tokens} tokens in {m.documents} documents, {len(m.shards)} shard(s), "
          f"vocabulary {m.vocab_size} ({m.dtype}), EOS id {m.eos_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
