"""Attention one block at a time, merged with the log-sum-exp rule (pure torch; no comm).

A rank's queries meet the keys and values of every rank in turn (around the ring, or all at
once after an all-gather); each meeting is up to four blocks of `trainer.parallel.context.plan`.
A block yields its own softmax-weighted values ``o_b`` and the log-sum-exp ``l_b`` of its scores
per query row. Partial results merge exactly, in any order (online softmax, as FlashAttention
does; Milakov & Gimelshein 2018)::

    l = log(e^l1 + e^l2),   o = o1 · e^(l1 - l) + o2 · e^(l2 - l)

Backward recomputes each block's probabilities from the final ``l`` (``p = e^(s - l)``, the
true softmax weights), so nothing of size T² is kept between forward and backward::

    dV = pᵀ dO,  dP = dO Vᵀ,  dS = p ⊙ (dP - Δ),  Δ = rowsum(dO ⊙ O),  dQ = dS K,  dK = dSᵀ Q

Grouped-query attention: queries are viewed as (B, G, R, T, K), G key/value heads and R query
heads per group (query head h reads key/value head h // R, as ``enable_gqa`` does), so a K/V
block is used by its R query heads without being repeated, and dK/dV sum over them.

Scores, probabilities and every accumulator are at least fp32 (fp64 stays fp64): bf16 inputs
go into the matmuls as they are, what comes out is widened before it is exponentiated or added.
The kernel is plain torch (a block materializes its c x c scores, c = seq_len / (2 cp)); a fused
kernel that returns the log-sum-exp can replace `block_forward`/`block_backward` one for one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.parallel.context.plan import Visibility

Block = tuple[int, int, Visibility]


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores and accumulators are kept in."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    s = torch.einsum("bgrqk,bgsk->bgrqs", q, k).to(wide(q.dtype)) * scale
    if causal:  # a diagonal block: query i sees keys 0..i of the same chunk
        n = s.shape[-1]
        above = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    return s


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_b (B, G, R, c, K), l_b (B, G, R, c)) of queries ``q`` against one key block."""
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    return torch.einsum("bgrqs,bgsk->bgrqk", p.to(v.dtype), v).to(s.dtype), lse


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor, scale: float, causal: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of one block, wide, from the final log-sum-exp and Δ of its query rows."""
    p = torch.exp(_scores(q, k, scale, causal) - lse[..., None])
    dv = torch.einsum("bgrqs,bgrqk->bgsk", p.to(dout.dtype), dout)
    dp = torch.einsum("bgrqk,bgsk->bgrqs", dout, v).to(p.dtype)
    ds = (p * (dp - delta[..., None])).to(q.dtype)
    dq = torch.einsum("bgrqs,bgsk->bgrqk", ds, k).to(p.dtype) * scale
    dk = torch.einsum("bgrqs,bgrqk->bgsk", ds, q).to(p.dtype) * scale
    return dq, dk, dv.to(p.dtype)


def _half(x: torch.Tensor, index: int) -> torch.Tensor:
    """Local chunk ``index`` (0 or 1) of a rank's tokens, along the sequence dim (-2)."""
    c = x.shape[-2] // 2
    return x[..., index * c:(index + 1) * c, :]


class Accumulator:
    """The merged forward result of one rank's queries (B, G, R, T_local, K) so far."""

    def __init__(self, q: torch.Tensor) -> None:
        self.out = torch.zeros(q.shape, dtype=wide(q.dtype), device=q.device)
        self.lse = torch.full(q.shape[:-1], float("-inf"), dtype=self.out.dtype, device=q.device)

    def add(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Sequence[Block],
            scale: float) -> None:
        """Merge the blocks ``plan`` lists of ``q`` against one rank's keys ``k``, ``v``."""
        c = q.shape[-2] // 2
        for qi, ki, seen in plan:
            o_b, l_b = block_forward(_half(q, qi), _half(k, ki), _half(v, ki), scale,
                                     seen is Visibility.DIAGONAL)
            rows = slice(qi * c, (qi + 1) * c)
            lse = self.lse[..., rows]
            merged = torch.logaddexp(lse, l_b)  # -inf (nothing yet) merges to l_b exactly
            self.out[..., rows, :] = (self.out[..., rows, :] * torch.exp(lse - merged)[..., None]
                                      + o_b * torch.exp(l_b - merged)[..., None])
            self.lse[..., rows] = merged


def backward_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                    lse: torch.Tensor, delta: torch.Tensor, plan: Sequence[Block], scale: float,
                    dq: torch.Tensor) -> torch.Tensor:
    """Add the blocks' dQ into ``dq`` and return their [dK, dV] (2, B, G, T_local, K), wide."""
    c = q.shape[-2] // 2
    dkv = torch.zeros((2, *k.shape), dtype=dq.dtype, device=k.device)
    for qi, ki, seen in plan:
        rows, cols = slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c)
        dq_b, dk_b, dv_b = block_backward(
            _half(q, qi), _half(k, ki), _half(v, ki), _half(dout, qi), lse[..., rows],
            delta[..., rows], scale, seen is Visibility.DIAGONAL)
        dq[..., rows, :] += dq_b
        dkv[0, ..., cols, :] += dk_b
        dkv[1, ..., cols, :] += dv_b
    return dkv


def delta_rows(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Δ = rowsum(dO ⊙ O), wide: what every block's dS subtracts."""
    return (dout.to(wide(dout.dtype)) * out.to(wide(out.dtype))).sum(-1)
