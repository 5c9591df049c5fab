"""Document masking under context parallelism: each block's mask from the window's global
document ids (`trainer.model.documents`).

Every cp rank gets the document ids of the whole window from the data loader (B, T int64;
`trainer.data.token_batches`), not only of its own chunks, so no rank needs another's ids: the
ids of a block's query chunk and of its key chunk are slices of the same tensor at the chunks'
global ranges (`SequenceLayout.ranges`), whichever rank holds the keys and however they
arrived (ring or all-gather). Exchanging them with K/V would cost a message per hop for what
the loader already had.

`document_plan` refines the causal plan (`trainer.parallel.context.plan.block_plan`) of one
(query rank, key rank) meeting: a block whose queries share no document with its keys is left
out (computed by nobody, forward or backward); a block whose queries and keys all lie in one
document keeps the plain causal treatment (no mask: the path of runs without document masking);
any other block carries its (B, c, c) mask, True where a query may attend (same document, and
key <= query on a diagonal block). The plan is rebuilt in backward from the same ids, so the
masks are never kept between forward and backward. The load-balance figures
(`attention_flops`) count the causal plan: document masking only removes work from it.
"""

from __future__ import annotations

import torch

from trainer.model.documents import same_document
from trainer.parallel.context.blocks import Block
from trainer.parallel.context.layout import ContextParallelError, SequenceLayout
from trainer.parallel.context.plan import Visibility, block_plan


def document_plan(layout: SequenceLayout, docs: torch.Tensor | None, q_rank: int,
                  kv_rank: int) -> list[Block]:
    """The blocks ``q_rank`` computes against ``kv_rank``'s keys, each with its document mask
    (None: causal only); ``docs``: the whole window's document ids, or None for no masking."""
    plan = block_plan(layout, q_rank, kv_rank)
    if docs is None:
        return [(qi, ki, seen, None) for qi, ki, seen in plan]
    queries, keys = layout.ranges(q_rank), layout.ranges(kv_rank)
    blocks: list[Block] = []
    for qi, ki, seen in plan:
        q_range, k_range = queries[qi], keys[ki]
        same = same_document(docs[:, q_range.start:q_range.stop],
                             docs[:, k_range.start:k_range.stop])
        if bool(same.all()):  # one document: the causal block as without masking
            blocks.append((qi, ki, seen, None))
            continue
        if seen is Visibility.DIAGONAL:
            same &= torch.ones(same.shape[-2:], dtype=torch.bool, device=same.device).tril()
        elif not bool(same.any()):  # no query sees any key: nothing to compute
            continue
        blocks.append((qi, ki, seen, same))
    return blocks


def check_documents(docs: torch.Tensor, layout: SequenceLayout, batch: int, where: str
                    ) -> None:
    """Refuse document ids that are not the whole window's (B, seq_len) integers."""
    if docs.dtype.is_floating_point or docs.dtype == torch.bool or \
            tuple(docs.shape) != (batch, layout.seq_len):
        raise ContextParallelError(
            "cannot mask documents in context-parallel attention", where,
            f"document ids {tuple(docs.shape)} {docs.dtype}: they must be the whole window's "
            f"integer ids, ({batch}, {layout.seq_len})",
            "Pass the loader's document ids of the whole window (not this rank's chunks)")
