"""Vocabulary padding, Megatron style: the embedding and head get ``vocab_size`` rounded up to
a multiple of ``vocab_multiple x tp`` rows, so every TP shard of the head is a multiple of 128
rows (whole tensor-core tiles). The padded rows are never predicted: their logits are set to
-inf before the loss and before sampling, so their probability is exactly 0, they add nothing
to the softmax's denominator and they get exactly zero gradient (the serial model's loss over
the real vocabulary, unchanged by the padding).

    python -m trainer.train --model gpt-124m --tp 2    # 50257 -> 50432 rows (a multiple of 256)
"""

from __future__ import annotations

import torch

#: GPT-2's BPE vocabulary size: the gpt-124m and gpt-350m presets use it (padded to 50304).
GPT2_VOCAB = 50257


def padded_size(size: int, multiple: int) -> int:
    """``size`` rounded up to a multiple of ``multiple``."""
    return -(-size // multiple) * multiple


def multiple_for_tp(vocab_multiple: int, tp: int) -> int:
    """The padding multiple of a run with ``tp`` ranks: ``vocab_multiple x tp`` when padding
    is asked for (> 1); 1 keeps the vocabulary as it is (it must then divide by tp)."""
    return vocab_multiple * tp if vocab_multiple > 1 else 1


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, start: int) -> torch.Tensor:
    """``logits`` (..., rows) of vocabulary rows ``start..start+rows`` with the rows at and past
    ``vocab_size`` set to -inf (returned as is when there are none)."""
    rows = logits.shape[-1]
    if start + rows <= vocab_size:
        return logits
    padded = torch.arange(start, start + rows, device=logits.device) >= vocab_size
    return logits.masked_fill(padded, float("-inf"))
