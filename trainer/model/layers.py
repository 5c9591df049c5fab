"""The GPT's layers: norms, rotary embeddings, attention, MLP and the pre-norm block.

Plain-attribute hooks let `trainer.parallel.tensor.parallelize` change what it cannot reach by
swapping modules: ``Attention.probs_rng`` (the random stream of attention-probability dropout);
and ``trainer.activations`` recompute a block (``Block.runner``) or the attention core
(``Attention.core_runner``) in backward. All default to the serial behaviour.

Shape legend: B batch, T sequence, D d_model, H heads, K head dim (D/H).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.model.config import GPTConfig
from trainer.model.documents import causal_document_mask
from trainer.model.linear import Linear

Runner = Callable[..., torch.Tensor]
"""``runner(fn, *tensors)`` runs ``fn(*tensors)``; a recompute hook runs it without keeping
its activations."""


def run_directly(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """The default `Runner`: call ``fn``, keeping its activations for backward."""
    return fn(*args)


def documents(docs: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The trailing arguments of a block or attention core: the window's document ids under
    ``--document-mask`` (`trainer.model.documents`), nothing otherwise, so that runs without it
    call (and recompute) exactly what they called before."""
    return () if docs is None else (docs,)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (no mean subtraction, no bias)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def make_norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


def rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (T, K/2) for rotary position embeddings (Su et al. 2021)."""
    # On the CPU even inside a meta-device block: small, and needed with real values.
    f64: dict[str, Any] = {"dtype": torch.float64, "device": "cpu"}
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, **f64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, **f64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x_BHTK: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) pair of channels by its position's angle: the pair read as one
    complex number times cos + i sin. One complex multiply forward and one backward, where the
    same rotation written on the real halves costs a dozen passes and zero-filled slice
    gradients (a step of the ``small`` model: 17 ms of 510 on one CPU core, `bench.nanogpt`).
    Half-precision inputs are rotated in fp32 (torch has no complex bf16)."""
    T, dtype = x_BHTK.shape[-2], x_BHTK.dtype
    wide = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    turn = torch.complex(cos[:T].to(wide), sin[:T].to(wide))
    pairs = torch.view_as_complex(x_BHTK.to(wide).unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * turn).flatten(-2).to(dtype)


def _as_complex(x: torch.Tensor) -> torch.Tensor:
    """Real (..., K) -> complex (..., K/2) pairs, a view where torch can make one."""
    pairs = x.unflatten(-1, (-1, 2))
    if x.storage_offset() % 2 or any(s % 2 for s in pairs.stride()[:-2]) or x.stride(-1) != 1:
        pairs = pairs.contiguous()
    return torch.view_as_complex(pairs)


def _rotate_into(out: torch.Tensor, x: torch.Tensor, turn: torch.Tensor) -> None:
    """``out`` = the pairs of ``x`` times ``turn`` (complex, broadcast), written in place;
    half precision through fp32 (torch has no complex bf16)."""
    if x.dtype in (torch.float32, torch.float64):
        torch.mul(_as_complex(x), turn, out=_as_complex(out))
    else:
        out.copy_(torch.view_as_real(_as_complex(x.float()) * turn).flatten(-2))


class RotaryQKV(torch.autograd.Function):
    """qkv (B, T, 3·H·K) -> q and k rotated (`apply_rope`'s arithmetic) and v, each (B, H, T, K)
    as views, in one pass each way. Forward writes the rotated q and k once, into one (B, T,
    2, H, K) tensor; backward writes the gradients of q, k and v straight into the (B, T, 3,
    H, K) gradient of qkv. Written with autograd's own ops (unbind, two `apply_rope`, permute
    back), backward took a stack and a permuting copy of the whole qkv gradient on top of the
    rotations: on one CPU core 3.1 against 2.0 ms per layer of the ``small`` model (median CPU
    time, 2026-11-28). The tables are expanded to (T, ·, H, K/2) so that the multiply's inner
    loop runs over H·K/2 pairs, not K/2. Bit for bit the autograd version's results in fp64, bf16
    and fp16, and in fp32 at head dims >= 32; below, that version's short rows ran torch's scalar
    complex loop, which rounds 1 ulp apart from its vector loop."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, qkv_BTD: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, head_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = qkv_BTD.shape
        qkv = qkv_BTD.view(B, T, 3, -1, head_dim)
        H, dtype = qkv.shape[3], qkv_BTD.dtype
        wide = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        turn = torch.complex(cos[:T].to(wide), sin[:T].to(wide))
        ctx.save_for_backward(turn)
        qk = qkv.new_empty((B, T, 2, H, head_dim))
        _rotate_into(qk, qkv[:, :, :2], turn[:, None, None].expand(T, 2, H, -1).contiguous())
        return (qk[:, :, 0].transpose(1, 2), qk[:, :, 1].transpose(1, 2),
                qkv[:, :, 2].transpose(1, 2))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor
                 ) -> tuple[torch.Tensor, None, None, None]:
        (turn,) = ctx.saved_tensors  # type: ignore[attr-defined]
        B, H, T, K = dq.shape
        grad = dq.new_empty((B, T, 3, H, K))
        back = turn.conj()[:, None].expand(T, H, -1).contiguous()  # the inverse rotation
        _rotate_into(grad[:, :, 0], dq.transpose(1, 2), back)
        _rotate_into(grad[:, :, 1], dk.transpose(1, 2), back)
        grad[:, :, 2].copy_(dv.transpose(1, 2))
        return grad.view(B, T, 3 * H * K), None, None, None


SplitQKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int],
                    tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v split from qkv's output and q, k rotated in one autograd pass (`RotaryQKV`)."""
    q, k, v = RotaryQKV.apply(qkv, cos, sin, head_dim)  # type: ignore[no-untyped-call]  # torch's Function.apply
    return q, k, v


def plain_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rotary_qkv` in plain ops, for tracers: RotaryQKV's in-place complex views are opaque to
    fake tensors and batching rules, and a compiler fuses the plain ops anyway."""
    B, T, _ = qkv.shape
    q, k, v = qkv.view(B, T, 3, -1, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class Attention(nn.Module):
    """Causal multi-head self-attention with RoPE. TP splits qkv by columns, proj by rows."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim, self.dropout = cfg.n_head, cfg.head_dim, cfg.dropout
        self.qkv = Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.probs_rng: Callable[[], AbstractContextManager[Any]] = nullcontext
        """Context the attention-probability dropout draws its mask under. Hook for tensor
        parallelism, where those probabilities are per rank (split heads) and need a random
        stream of their own; the serial model uses the default generator."""
        self.core_runner: Runner = run_directly
        """How `core` runs (hook for selective recomputation)."""
        self.split_qkv: SplitQKV = rotary_qkv
        """qkv's output -> rotated q, k and v (B, H, T, K): one fused autograd pass, or the
        plain ops (`plain_qkv`) where they must be traced (compiled blocks, vmap)."""

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             docs: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(QKᵀ/√K) with dropout, times V: the part that holds O(T²) activations;
        causal, and within documents when given the window's document ids ``docs`` (B, T)."""
        p = self.dropout if self.training else 0.0
        with self.probs_rng():
            if docs is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_document_mask(docs),
                                                  dropout_p=p)

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv(x_BTD)
        # From qkv's output: under sequence parallelism x is a sequence block, qkv's output the
        # whole sequence. The head count is taken from the weight, so a TP shard works as is.
        B, T, _ = qkv.shape
        q, k, v = self.split_qkv(qkv, cos, sin, self.head_dim)
        y = self.core_runner(self.core, q, k, v, *documents(docs))
        y_BTD = y.transpose(1, 2).reshape(B, T, -1)
        out: torch.Tensor = self.resid_drop(self.proj(y_BTD))
        return out


class MLP(nn.Module):
    """fc (D -> ratio*D) -> GELU -> proj (ratio*D -> D)."""

    fc_stride = 1
    """``fc`` is one part (a SwiGLU's stacks two; tensor parallelism cuts each part)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.fc = Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.proj = Linear(hidden, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.drop(self.proj(F.gelu(self.fc(x_BTD))))
        return out


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        (self.ln1, self.attn), (self.ln2, self.mlp) = self.parts(cfg)
        self.runner: Runner = run_directly
        """How `body` runs (hook for full recomputation)."""

    @staticmethod
    def parts(cfg: GPTConfig) -> tuple[tuple[nn.Module, nn.Module], tuple[nn.Module, nn.Module]]:
        """(ln1, attn), (ln2, mlp): the GPT's; a model family's block overrides only this."""
        return (make_norm(cfg), Attention(cfg)), (make_norm(cfg), MLP(cfg))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: torch.Tensor | None = None) -> torch.Tensor:
        """``docs``: the window's document ids under ``--document-mask``, else None."""
        return self.runner(self.body, x, cos, sin, *documents(docs))

    def body(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             docs: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cos, sin, docs)
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out

