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

import torch
import torch.nn.functional as F
from torch import nn

from trainer.model.config import GPTConfig

Runner = Callable[..., torch.Tensor]
"""``runner(fn, *tensors)`` runs ``fn(*tensors)``; a recompute hook runs it without keeping
its activations."""


def run_directly(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """The default `Runner`: call ``fn``, keeping its activations for backward."""
    return fn(*args)


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
    f64 = {"dtype": torch.float64, "device": "cpu"}
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


class Attention(nn.Module):
    """Causal multi-head self-attention with RoPE. TP splits qkv by columns, proj by rows."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim, self.dropout = cfg.n_head, cfg.head_dim, cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.probs_rng: Callable[[], AbstractContextManager] = nullcontext
        """Context the attention-probability dropout draws its mask under. Hook for tensor
        parallelism, where those probabilities are per rank (split heads) and need a random
        stream of their own; the serial model uses the default generator."""
        self.core_runner: Runner = run_directly
        """How `core` runs (hook for selective recomputation)."""

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(QKᵀ/√K) with dropout, times V: the part that holds O(T²) activations."""
        with self.probs_rng():
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x_BTD)
        # From qkv's output: under sequence parallelism x is a sequence block, qkv's output the
        # whole sequence. The head count is taken from the weight, so a TP shard works as is.
        B, T, _ = qkv.shape
        qkv = qkv.view(B, T, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # one stacked gradient in backward, not three zero-filled
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.core_runner(self.core, q, k, v)
        y_BTD = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_drop(self.proj(y_BTD))


class MLP(nn.Module):
    """fc (D -> ratio*D) -> GELU -> proj (ratio*D -> D)."""

    fc_stride = 1
    """``fc`` is one part (a SwiGLU's stacks two; tensor parallelism cuts each part)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.fc = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.proj = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x_BTD))))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.attn = make_norm(cfg), Attention(cfg)
        self.ln2, self.mlp = make_norm(cfg), MLP(cfg)
        self.runner: Runner = run_directly
        """How `body` runs (hook for full recomputation)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.runner(self.body, x, cos, sin)

    def body(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cos, sin)
        return x + self.mlp(self.ln2(x))

