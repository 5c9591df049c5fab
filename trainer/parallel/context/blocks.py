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
On the CPU a block runs torch's fused attention kernel (``_scaled_dot_product_flash_attention_
for_cpu`` and its backward: tiled, it returns the log-sum-exp and never holds a block's c x c
scores, c = seq_len / (2 cp); its backward forms Δ from the final output it is given); on other
devices the plain torch path below, which materialises them. Both give the same (o_b, l_b) and
gradients; a block's K/V head is expanded to its R query heads for the kernel (a copy of one
block's K/V, not of the sequence's).

Document masking (`trainer.parallel.context.documents`): a block may come with a mask (B, c, c),
True where a query may see a key (same document, and causal on a diagonal block), which replaces
the causal flag; the fused kernel takes it as an additive 0/-inf mask of the block. A query row
may then see nothing of a block. The fused kernel returns o = 0 and a log-sum-exp of 0 for such
a row, the plain path -inf and NaN; both are put to (o_b, l_b) = (0, -inf), the neutral element
of the merge, and the merge keeps a row that has seen nothing yet at (0, -inf) instead of
computing e^(-inf - -inf). Every row sees at least itself on its diagonal block, so the merged
log-sum-exp is finite and backward's p = e^(s - l) is 0 at every masked key.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.parallel.context.plan import Visibility

Block = tuple[int, int, Visibility, torch.Tensor | None]
"""(local query chunk, local key chunk, visibility, document mask (B, c, c) or None)."""


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores and accumulators are kept in."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    s = torch.einsum("bgrqk,bgsk->bgrqs", q, k).to(wide(q.dtype)) * scale
    if mask is not None:  # documents (and the causal triangle on a diagonal block)
        return s.masked_fill(~mask[:, None, None], float("-inf"))
    if causal:  # a diagonal block: query i sees keys 0..i of the same chunk
        n = s.shape[-1]
        above = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    return s


def _heads(q: torch.Tensor, *kv: torch.Tensor) -> list[torch.Tensor]:
    """(B, G, R, c, K) queries and (B, G, c, K) keys or values as the fused kernel's (B, G·R,
    c, K): each key/value head expanded to its R query heads (a copy of one block's K/V)."""
    b, g, r, c, k = q.shape
    return [q.flatten(1, 2), *(t[:, :, None].expand(b, g, r, c, k).flatten(1, 2) for t in kv)]


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A block's document mask as the fused kernel takes it: (B, 1, c, c), 0 or -inf."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, float("-inf"))[:, None]


def _fused_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   causal: bool, mask: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_forward` by torch's fused CPU attention, which returns the log-sum-exp and never
    holds the c x c scores (but for a document mask's)."""
    q4, k4, v4 = _heads(q, k, v)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q4, k4, v4, 0.0, causal and mask is None, attn_mask=_additive(mask, q.dtype),
        scale=scale)
    w = wide(q.dtype)
    return o.unflatten(1, q.shape[1:3]).to(w), lse.unflatten(1, q.shape[1:3]).to(w)


def fused_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool,
                    mask: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`block_backward` by the fused CPU kernel's backward, given the final output of the
    block's query rows (it forms Δ = rowsum(dO ⊙ O) itself) and their final log-sum-exp."""
    q4, k4, v4 = _heads(q, k, v)
    heads = q.shape[1:3]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.flatten(1, 2).contiguous(), q4, k4, v4, out.flatten(1, 2).contiguous(),
        lse.flatten(1, 2).to(_lse_dtype(q.dtype)).contiguous(), 0.0, causal and mask is None,
        attn_mask=_additive(mask, q.dtype), scale=scale)
    w = wide(q.dtype)
    return (dq.unflatten(1, heads).to(w), dk.unflatten(1, heads).sum(2, dtype=w),
            dv.unflatten(1, heads).sum(2, dtype=w))


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def plain_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool, mask: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_forward`'s plain torch path (devices other than the CPU): the scores whole."""
    s = _scores(q, k, scale, causal, mask)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    return torch.einsum("bgrqs,bgsk->bgrqk", p.to(v.dtype), v).to(s.dtype), lse


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool, mask: torch.Tensor | None = None, *, fused: bool | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_b (B, G, R, c, K), l_b (B, G, R, c)) of queries ``q`` against one key block; under
    a document ``mask`` a row that sees no key of the block is (0, -inf). ``fused``: the CPU
    kernel or the plain path (None: the kernel on the CPU, the plain path elsewhere)."""
    fused = q.device.type == "cpu" if fused is None else fused
    forward = _fused_forward if fused else plain_forward
    o, lse = forward(q, k, v, scale, causal, mask)
    if mask is not None:
        empty = ~mask.any(-1)[:, None, None]  # (B, 1, 1, c): rows that see nothing here
        o, lse = o.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, float("-inf"))
    return o, lse


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor, scale: float, causal: bool,
                   mask: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of one block, wide, from the final log-sum-exp and Δ of its query rows."""
    p = torch.exp(_scores(q, k, scale, causal, mask) - lse[..., None])
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
        for qi, ki, seen, mask in plan:
            o_b, l_b = block_forward(_half(q, qi), _half(k, ki), _half(v, ki), scale,
                                     seen is Visibility.DIAGONAL, mask)
            rows = slice(qi * c, (qi + 1) * c)
            lse = self.lse[..., rows]
            merged = torch.logaddexp(lse, l_b)  # -inf (nothing yet) merges to l_b exactly
            # A row that has seen nothing yet (only under document masks) stays (0, -inf):
            # shifting by 0 there gives weights e^-inf = 0 instead of e^(-inf - -inf) = NaN.
            shift = merged if mask is None else merged.masked_fill(merged.isneginf(), 0.0)
            self.out[..., rows, :] = (self.out[..., rows, :] * torch.exp(lse - shift)[..., None]
                                      + o_b * torch.exp(l_b - shift)[..., None])
            self.lse[..., rows] = merged


def backward_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
                    plan: Sequence[Block], scale: float, dq: torch.Tensor) -> torch.Tensor:
    """Add the blocks' dQ into ``dq`` and return their [dK, dV] (2, B, G, T_local, K), wide.
    ``out``: the final output of this rank's queries (the fused kernel forms Δ from it)."""
    c = q.shape[-2] // 2
    dkv = torch.zeros((2, *k.shape), dtype=dq.dtype, device=k.device)
    fused = q.device.type == "cpu"
    for qi, ki, seen, mask in plan:
        rows, cols = slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c)
        causal = seen is Visibility.DIAGONAL
        if fused:
            dq_b, dk_b, dv_b = fused_backward(
                _half(q, qi), _half(k, ki), _half(v, ki), _half(dout, qi), _half(out, qi),
                lse[..., rows], scale, causal, mask)
        else:
            dq_b, dk_b, dv_b = block_backward(
                _half(q, qi), _half(k, ki), _half(v, ki), _half(dout, qi), lse[..., rows],
                delta[..., rows], scale, causal, mask)
        dq[..., rows, :] += dq_b
        dkv[0, ..., cols, :] += dk_b
        dkv[1, ..., cols, :] += dv_b
    return dkv


def delta_rows(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Δ = rowsum(dO ⊙ O), wide: what every block's dS subtracts."""
    return (dout.to(wide(dout.dtype)) * out.to(wide(out.dtype))).sum(-1)
