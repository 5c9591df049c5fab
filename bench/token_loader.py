"""Tokenized data: how fast one rank reads batches, and how fast ``prepare`` tokenizes.

    python -m bench.token_loader [--tokens 50000000] [--text-mb 16]

1. ``loader``: a dataset of random uint16 tokens written straight into shards
   (`trainer.data.shard_writer`, checksums included) is read by one rank's `TokenBatches` at
   dp 1, for a short and a long context; tokens/s of batches made (the first pass over each
   block includes its checksum) against the tokens/s that training consumes: dtrain's
   ``llama-tiny`` training step on this CPU, the most demanding consumer (target >= 100x).
2. ``prepare``: ``python -m trainer.data.prepare --tokenizer`` on JSON-lines files against
   ``tokenizers``' own ``encode_batch_fast`` of the same documents (read from the same files,
   the whole file in one batch), in MB of input per second; the BPE is trained first (not
   timed).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from trainer.data.batches import BatchPlan
from trainer.data.prepare import documents, prepare, train_bpe
from trainer.data.shard_writer import ShardWriter
from trainer.data.token_batches import TokenBatches
from trainer.data.token_files import MANIFEST, Manifest, token_dtype
from trainer.model.config import PRESETS
from trainer.model.llama import Llama

Row = dict[str, Any]
VOCAB = 32768


def random_dataset(folder: Path, tokens: int, shard_tokens: int = 1 << 25) -> Path:
    """``tokens`` random ids in shards, with a manifest, written without a tokenizer."""
    folder.mkdir()
    writer = ShardWriter(folder, token_dtype(VOCAB), shard_tokens)
    rng = np.random.default_rng(0)
    for start in range(0, tokens, 1 << 22):
        writer.add(rng.integers(0, VOCAB, min(1 << 22, tokens - start), dtype=np.uint16))
    writer.close()
    manifest = Manifest(VOCAB, 0, token_dtype(VOCAB).str, tuple(writer.shards),
                        writer.documents, writer.files)
    (folder / MANIFEST).write_text(manifest.to_json())
    return folder


def training_tokens_per_s(steps: int = 5) -> float:
    """dtrain's llama-tiny training tokens/s on this CPU (batch 16, AdamW, fp32)."""
    cfg = PRESETS["llama-tiny"]
    model = Llama(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (16, cfg.seq_len + 1))
    for i in range(steps + 1):
        if i == 1:
            start = time.perf_counter()
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return 16 * cfg.seq_len * steps / (time.perf_counter() - start)


def loader(folder: Path, seq_len: int, batch: int, seconds: float) -> float:
    """Tokens/s of input batches one rank makes (the whole microbatch list of each step)."""
    loader = TokenBatches([(folder, 1.0)], seq_len=seq_len, plan=BatchPlan(batch, 1, 1),
                          seed=0, dp_rank=0, model_vocab=VOCAB)
    start, step = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        loader.microbatches(step)
        step += 1
    return step * batch * seq_len / (time.perf_counter() - start)


def prepare_rates(root: Path, text_mb: float, reps: int = 3) -> Row:
    """MB/s of prepare and of tokenizers' encode_batch_fast on four JSON-lines files of
    ~2 KB documents; median of ``reps`` alternating runs, each with a freshly loaded
    tokenizer (its word cache empty)."""
    words = [f"w{i}" for i in range(3000)] + ["the", "a", "of", "\n"]
    files = []
    for k in range(4):
        rnd = random.Random(k)
        path = root / f"text{k}.jsonl"
        docs = int(text_mb * 2**20 / 4 / 2048)
        path.write_text("".join(json.dumps({"text": " ".join(rnd.choices(words, k=400))}) + "\n"
                                for _ in range(docs)))
        files.append(path)
    train_bpe(files[:1], 4096).save(str(root / "tok.json"))
    total = sum(p.stat().st_size for p in files) / 2**20
    ours, theirs = [], []
    for rep in range(reps):
        for side in ("prepare", "tokenizers")[::1 if rep % 2 == 0 else -1]:
            start = time.perf_counter()
            if side == "prepare":
                prepare(files, root / f"ds{rep}", tokenizer=root / "tok.json", quiet=True)
                ours.append(total / (time.perf_counter() - start))
            else:
                tok = Tokenizer.from_file(str(root / "tok.json"))
                for path in files:
                    tok.encode_batch_fast([text for text, _ in documents(path)],
                                          add_special_tokens=False)
                theirs.append(total / (time.perf_counter() - start))
    mine, peer = statistics.median(ours), statistics.median(theirs)
    return {"part": "prepare", "text_mb": round(total, 1), "prepare_mb_per_s": round(mine, 2),
            "tokenizers_mb_per_s": round(peer, 2), "ratio": round(mine / peer, 3)}


def run(tokens: int = 50_000_000, text_mb: float = 16.0, seconds: float = 3.0) -> list[Row]:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="dtrain-loader-") as tmp:
        folder = random_dataset(Path(tmp) / "random", tokens)
        consumed = training_tokens_per_s()
        for seq_len, batch in ((64, 16), (2048, 8)):
            made = loader(folder, seq_len, batch, seconds)
            rows.append({"part": "loader", "dataset_tokens": tokens, "seq_len": seq_len,
                         "batch": batch, "loader_tokens_per_s": round(made),
                         "training_tokens_per_s": round(consumed),
                         "ratio": round(made / consumed, 1)})
        rows.append(prepare_rates(Path(tmp), text_mb))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=50_000_000)
    parser.add_argument("--text-mb", type=float, default=16.0)
    args = parser.parse_args()
    for row in run(args.tokens, args.text_mb):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
