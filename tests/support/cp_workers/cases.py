"""What the context-parallel attention ranks compute, and the single-process reference.

Shared by the MPI rank function and the pytest process, so both build bit-identical inputs
from one seeded generator: fp64 q, k, v and the output gradient of the whole sequence; the
``-docs`` cases add document ids (`trainer.model.documents`) whose boundaries fall inside
chunks, on chunk edges, and make one-token documents, so that at cp 4 some blocks are wholly
masked, some partly (rows that see none of a block's keys), and one sample is a single document.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from trainer.model.documents import causal_document_mask, document_ids

#: The rank function the attention tests read (one run per cp size: `tests.support.mpi_runs`).
WORKER = "tests.support.cp_workers.attention:run"

B, T, HEAD_DIM = 2, 32, 8
"""T divides 2 x cp for cp 1, 2 and 4 (chunks of 16, 8 and 4 tokens)."""
HEADS = {"mha": (4, 4), "gqa": (8, 2)}
"""(query heads, key/value heads) per case."""
SCALE = 1.0 / math.sqrt(HEAD_DIM)
CASES = (*HEADS, *(f"{case}-docs" for case in HEADS))
"""Every head case, causal over the window and masked by documents."""
EOS_AT = (2, 3, 8, 13, 24, 30)
"""Where sample 0's documents end (sample 1 is one document): one-token documents at 3, a
boundary on the chunk edges of cp 4 (8) and inside chunks."""


def heads(case: str) -> tuple[int, int]:
    return HEADS[case.removesuffix("-docs")]


@functools.cache
def documents(case: str) -> torch.Tensor | None:
    """The window's document ids (B, T) of a ``-docs`` case, None for the others."""
    if not case.endswith("-docs"):
        return None
    tokens = torch.ones(B, T, dtype=torch.int64)
    tokens[0, list(EOS_AT)] = 0
    return document_ids(tokens, eos_id=0)


@functools.cache
def attention_tensors(case: str) -> dict[str, torch.Tensor]:
    """q (B, H, T, K), k and v (B, G, T, K), dout like q: the whole sequence, fp64."""
    n_heads, kv_heads = heads(case)
    g = torch.Generator().manual_seed(37 + n_heads)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {"q": randn(B, n_heads, T, HEAD_DIM), "k": randn(B, kv_heads, T, HEAD_DIM),
            "v": randn(B, kv_heads, T, HEAD_DIM), "dout": randn(B, n_heads, T, HEAD_DIM)}


@functools.cache
def serial(case: str) -> dict[str, torch.Tensor]:
    """Full causal attention of the unsplit sequence on one process, torch's own kernel (with
    the documents' mask in the ``-docs`` cases)."""
    t, docs = attention_tensors(case), documents(case)
    q, k, v = (t[name].clone().requires_grad_(True) for name in "qkv")
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa) \
        if docs is None else \
        F.scaled_dot_product_attention(q, k, v, attn_mask=causal_document_mask(docs),
                                       enable_gqa=gqa)
    out.backward(t["dout"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
