"""What the context-parallel attention ranks compute, and the single-process reference.

Shared by the MPI rank function and the pytest process, so both build bit-identical inputs
from one seeded generator: fp64 q, k, v and the output gradient of the whole sequence.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

#: The rank function the attention tests read (one run per cp size: `tests.support.mpi_runs`).
WORKER = "tests.support.cp_workers.attention:run"

B, T, HEAD_DIM = 2, 32, 8
"""T divides 2 x cp for cp 1, 2 and 4 (chunks of 16, 8 and 4 tokens)."""
HEADS = {"mha": (4, 4), "gqa": (8, 2)}
"""(query heads, key/value heads) per case."""
SCALE = 1.0 / math.sqrt(HEAD_DIM)


@functools.cache
def attention_tensors(case: str) -> dict[str, torch.Tensor]:
    """q (B, H, T, K), k and v (B, G, T, K), dout like q: the whole sequence, fp64."""
    heads, kv_heads = HEADS[case]
    g = torch.Generator().manual_seed(37 + heads)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {"q": randn(B, heads, T, HEAD_DIM), "k": randn(B, kv_heads, T, HEAD_DIM),
            "v": randn(B, kv_heads, T, HEAD_DIM), "dout": randn(B, heads, T, HEAD_DIM)}


@functools.cache
def serial(case: str) -> dict[str, torch.Tensor]:
    """Full causal attention of the unsplit sequence on one process, torch's own kernel."""
    t = attention_tensors(case)
    q, k, v = (t[name].clone().requires_grad_(True) for name in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                         enable_gqa=q.shape[1] != k.shape[1])
    out.backward(t["dout"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
