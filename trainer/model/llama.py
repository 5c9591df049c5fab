"""A plain single-device Llama: the reference every parallel Llama layout is compared against.

It is the GPT's decoder (`trainer.model.gpt`) with Llama's parts inside each block, under the
same module names, so the parallel machinery that replaces named submodules applies to both:

    tok_emb                      nn.Embedding(vocab, d_model)
    blocks["i"]  LlamaBlock      ln1 (RMSNorm) -> attn (q, kv, proj) -> +res,
                                 ln2 (RMSNorm) -> mlp (fc, proj) -> +res
    ln_f                         final RMSNorm
    head                         nn.Linear(d_model, vocab), untied unless ``cfg.tied``

Grouped-query attention keeps the query projection ``q`` (D -> H·K) apart from the fused key and
value projection ``kv`` (D -> [k; v], 2·Hkv·K): tensor parallelism splits ``q`` by heads and
``kv`` with stride 2 (each rank gets the key and value heads of its query heads' groups) when the
key/value heads divide over tp, and replicates ``kv`` otherwise. The SwiGLU MLP fuses the gate
and up projections into ``fc`` (D -> [gate; up], 2·F), split with stride 2 the same way
(``fc_stride``); ``proj`` is the down projection. Output projections are named ``proj`` so the
GPT's init rule (`trainer.model.gpt.init_rule`: residual projections scaled by
1/sqrt(2·n_layer)) and every rule keyed on names apply unchanged.

Rotary embeddings rotate the pair (i, i + K/2) of each head, Hugging Face's ``rotate_half``
layout (the GPT rotates (2i, 2i+1)): the weights of a Hugging Face Llama load without any
permutation of q or k (`trainer.hf`). The tables are (T, K): cos and signed sin per channel.

Shape legend: B batch, T sequence, D d_model, H query heads, G key/value heads, K head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.model.config import GPTConfig
from trainer.model.documents import causal_document_mask
from trainer.model.gpt import GPT
from trainer.model.layers import Block, RMSNorm, Runner, documents, run_directly
from trainer.model.linear import Linear


def inv_frequencies(cfg: GPTConfig) -> torch.Tensor:
    """The K/2 rotary frequencies (fp64), with Llama 3's scaling when ``cfg`` asks for it."""
    k = cfg.head_dim
    # Real values even on the meta device.
    cpu64: dict[str, Any] = {"dtype": torch.float64, "device": "cpu"}
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, k, 2, **cpu64) / k))
    if cfg.llama.rope_scaling == "none":
        return inv
    old = cfg.llama.rope_original_seq_len
    low, high = cfg.llama.rope_low_freq_factor, cfg.llama.rope_high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / cfg.llama.rope_factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / cfg.llama.rope_factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)


def llama_rope_tables(cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables `apply_rope_half` multiplies by, (T, K) fp32 each: [cos, cos] and
    [-sin, sin] of every position's K/2 angles (computed in fp64 on the CPU, real even on the
    meta device)."""
    positions = torch.arange(cfg.seq_len, dtype=torch.float64, device="cpu")
    angles = torch.outer(positions, inv_frequencies(cfg))
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], -1).float(), torch.cat([-sin, sin], -1).float()


def apply_rope_half(x_BTHK: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (i, i + K/2) of channels by its position's angle: Hugging Face's
    ``x·cos + rotate_half(x)·sin``, with rotate_half(x) = [-x2, x1] written as a roll of x
    by K/2 times the signed table (one copy instead of two halves and a concatenation)."""
    T, K = x_BTHK.shape[1], x_BTHK.shape[-1]
    cos, sin = cos[:T, None].to(x_BTHK.dtype), sin[:T, None].to(x_BTHK.dtype)
    return x_BTHK * cos + x_BTHK.roll(K // 2, -1) * sin


class GQAttention(nn.Module):
    """Causal grouped-query self-attention with half-split RoPE, no biases."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim, self.dropout = cfg.head_dim, cfg.dropout
        self.q = Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.kv = Linear(cfg.d_model, 2 * cfg.kv_heads * cfg.head_dim, bias=False)
        self.proj = Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.probs_rng: Callable[[], AbstractContextManager[Any]] = nullcontext
        """Context of the attention-probability dropout (hook for tensor parallelism, as in
        `trainer.model.layers.Attention`)."""
        self.core_runner: Runner = run_directly
        """How `core` runs (hook for selective recomputation)."""

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             docs: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(QKᵀ/√K) V, query head h reading key/value head h // (H/G); causal, and
        within documents when given the window's document ids ``docs`` (B, T)."""
        p, gqa = self.dropout if self.training else 0.0, q.shape[1] != k.shape[1]
        with self.probs_rng():
            if docs is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p,
                                                      enable_gqa=gqa)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_document_mask(docs),
                                                  dropout_p=p, enable_gqa=gqa)

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: torch.Tensor | None = None) -> torch.Tensor:
        # Head counts come from the outputs, so a tensor-parallel shard (fewer heads) and a
        # sequence-parallel input (a sequence block; the outputs span the sequence) work as is.
        # Heads stay in (B, T, H, K) memory order and attention gets transposed views: the CPU
        # attention kernels work in that order, so they copy nothing.
        q = self.q(x_BTD)
        B, T, _ = q.shape
        # unbind, not indexing: its backward stacks the two gradients instead of zero-filling
        # the whole [k; v] gradient once per index.
        k_BTGK, v_BTGK = self.kv(x_BTD).view(B, T, 2, -1, self.head_dim).unbind(2)
        q_BTHK = apply_rope_half(q.view(B, T, -1, self.head_dim), cos, sin)
        k_BTGK = apply_rope_half(k_BTGK, cos, sin)
        y = self.core_runner(self.core, q_BTHK.transpose(1, 2), k_BTGK.transpose(1, 2),
                             v_BTGK.transpose(1, 2), *documents(docs))
        out: torch.Tensor = self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, -1)))
        return out


class SwiGLU(nn.Module):
    """fc (D -> [gate; up]) -> silu(gate) * up -> proj (F -> D)."""

    fc_stride = 2
    """``fc`` stacks two equal parts; tensor parallelism cuts each part over the ranks."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = Linear(cfg.d_model, 2 * cfg.hidden, bias=False)
        self.proj = Linear(cfg.hidden, cfg.d_model, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc(x_BTD).chunk(2, dim=-1)
        out: torch.Tensor = self.drop(self.proj(F.silu(gate) * up))
        return out


class LlamaBlock(Block):
    """Pre-norm Llama block: `trainer.model.layers.Block` with RMSNorm, grouped-query attention
    and the SwiGLU MLP (its forward, body and hooks)."""

    @staticmethod
    def parts(cfg: GPTConfig) -> tuple[tuple[nn.Module, nn.Module], tuple[nn.Module, nn.Module]]:
        return ((RMSNorm(cfg.d_model, cfg.norm_eps), GQAttention(cfg)),
                (RMSNorm(cfg.d_model, cfg.norm_eps), SwiGLU(cfg)))


class Llama(GPT):
    """Token ids (B, T) -> logits (B, T, V), initialised deterministically from ``seed``.

    A `GPT` in everything but its blocks and rotary tables: forward, loss, init and the hooks
    are the GPT's, so every caller that takes a GPT takes a Llama. Its final norm is the GPT's
    for ``norm = "rmsnorm"``, which a Llama config requires."""

    make_block = staticmethod(LlamaBlock)
    make_mlp = staticmethod(SwiGLU)

    @staticmethod
    def rope_tables(cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
        return llama_rope_tables(cfg)
