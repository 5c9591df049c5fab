"""A checkpoint of any layout back into the single-device `trainer.model.gpt.GPT`, on one process.

A checkpoint's index records where every saved slice of every global tensor lies (its global
name and shape, its TP cut, its ZeRO-1 range: `trainer.checkpoint`), so the merge reads the
metadata only: each whole tensor of the main weights is put together from its slices
(`trainer.checkpoint.pieces.assemble`), whatever layout or ZeRO stage wrote them; no
parallel model is built. The result is loaded strictly: a missing or extra tensor is an error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainer import checkpoint
from trainer.checkpoint.pieces import assemble
from trainer.model.config import GPTConfig
from trainer.model.family import build_model
from trainer.model.gpt import GPT


def load_serial(path: Path) -> tuple[GPT, dict[str, Any]]:
    """The single-device GPT of the committed checkpoint folder ``path``, and its meta (every
    file read is verified against the commit record)."""
    _, meta = checkpoint.read_meta(path)
    cfg = GPTConfig.from_dict(meta["model"])
    full = assemble(path)  # sized by the index, which its files back (checkpoint.bounds)
    if cfg.tied and "tok_emb.weight" in full:  # the head *is* the embedding
        full["head.weight"] = full["tok_emb.weight"]
    with torch.device("meta"):  # the model's shapes, allocating nothing: meta.json says them
        shapes = {k: tuple(v.shape) for k, v in build_model(cfg).state_dict().items()}
    wrong = [f"{k}: model {list(s)}, tensors {list(full[k].shape)}" for k, s in shapes.items()
             if k in full and tuple(full[k].shape) != s]
    wrong += [f"{k}: missing" for k in sorted(set(shapes) - set(full))]
    if wrong:
        raise checkpoint.CheckpointError(
            "checkpoint does not rebuild the model", str(path),
            "its meta.json's model and its tensors differ: " + "; ".join(wrong[:3]),
            "Restore the checkpoint from a copy")
    model = build_model(cfg)
    try:
        model.load_state_dict(full)
    except RuntimeError as exc:
        raise checkpoint.CheckpointError(
            "checkpoint does not rebuild the model", str(path), str(exc).splitlines()[0],
            "Check that every tensor file listed in its index.json is there") from None
    return model.eval(), meta
