"""Document masking of packed sequences: a token attends only to the earlier tokens of its own
document (``--document-mask``; Megatron's ``reset_attention_mask``, torchtitan's document
masking).

Tokenized data is packed: documents back to back, each ended by the tokenizer's EOS id
(`trainer.data.token_files`), and a training window cuts through them wherever it starts. With
document masking every token gets the number of its document inside the window, counted from
the window's first token (`document_ids`): 0 up to and including the first EOS, 1 after it, and
so on. The EOS closes its document (it belongs to it, as in Megatron, whose mask starts the
next document right after the EOS). Attention then keeps the pairs (query i, key j) with
``j <= i`` and ``docs[j] == docs[i]`` (`causal_document_mask`): the causal mask intersected
with the block diagonal of the documents. A query always sees itself, so no row is empty.

The ids are computed by the data loader on the whole window before anything splits it
(context parallelism's chunks, sequence parallelism's blocks) and travel with the batch as one
(B, T) int64 tensor per microbatch (`trainer.data.token_batches`); every layout derives its
masks from the same global ids, so masked attention is the same function of the window on any
layout. Positions stay global (Megatron's default, ``reset_position_ids`` off): the rotary
angle of a token is its place in the window, not in its document. Attention within a document
depends only on position differences, which are the same either way; what differs is only that
a document cut by the window start does not begin at angle 0, which rotary embeddings are
built to ignore.
"""

from __future__ import annotations

import torch


def document_ids(inputs_BT: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Each token's document number inside its window (B, T) int64: the count of EOS ids
    strictly before it (an EOS belongs to the document it ends)."""
    ends = (inputs_BT == eos_id).to(torch.int64)
    return torch.cumsum(ends, dim=1) - ends


def same_document(query_docs: torch.Tensor, key_docs: torch.Tensor) -> torch.Tensor:
    """(B, Tq, Tk) bool: query i and key j lie in the same document."""
    return query_docs[:, :, None] == key_docs[:, None, :]


def causal_document_mask(docs_BT: torch.Tensor) -> torch.Tensor:
    """The attention mask of a whole window (B, 1, T, T) bool, True where a query may attend:
    causal and within its document (broadcast over heads, as ``scaled_dot_product_attention``
    takes it)."""
    T = docs_BT.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=docs_BT.device).tril()
    return (same_document(docs_BT, docs_BT) & causal)[:, None]
