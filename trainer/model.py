"""A plain single-device GPT: the reference every parallel test compares against.

No parallel code lives here. Tensor and pipeline parallelism are applied later, in one place,
by replacing or removing the named submodules below (torchtitan's ``parallelize`` pattern):

    tok_emb                      nn.Embedding(vocab, d_model)
    blocks["0"] .. blocks["L-1"] Block: ln1 -> attn (qkv, proj) -> +res,
                                        ln2 -> mlp (fc, proj) -> +res
    ln_f                         final norm
    head                         nn.Linear(d_model, vocab); its weight *is* tok_emb.weight when tied

``blocks`` is an ``nn.ModuleDict`` keyed by the *global* layer index, so a pipeline stage that
deletes the layers it does not own keeps the global parameter names (``blocks.5.attn.qkv.weight``)
and checkpoints cannot silently load layer 0 of one layout into layer 5 of another. ``forward``
skips ``tok_emb``/``ln_f``/``head`` when they are ``None`` for the same reason.

Plain-attribute hooks let ``trainer.parallelize`` change what it cannot reach by swapping
modules: ``Attention.probs_rng`` (the random stream of attention-probability dropout) and
``GPT.criterion`` (the loss on the head's logits); and ``trainer.activations`` recompute a
block (``Block.runner``) or the attention core (``Attention.core_runner``) in backward. All
default to the serial behaviour; so does ``GPT.vocab_start``, the vocabulary row of the first
logit, which masks padded rows on a shard.

Shape legend: B batch, T sequence, D d_model, H heads, K head dim (D/H), V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.gpu.vocab import GPT2_VOCAB, mask_padded_vocab, padded_size
from trainer.precision import at_least_fp32

NORMS = ("layernorm", "rmsnorm")

Runner = Callable[..., torch.Tensor]
"""``runner(fn, *tensors)`` runs ``fn(*tensors)``; a recompute hook runs it without keeping
its activations."""


def run_directly(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """The default `Runner`: call ``fn``, keeping its activations for backward."""
    return fn(*args)


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Model size and shape. Everything that changes the parameter set or the math is here."""

    vocab_size: int = 256
    """Byte-level by default: one token per byte."""
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    seq_len: int = 64
    """Maximum (and training) context length; the RoPE tables are built for it."""
    dropout: float = 0.0
    tied: bool = True
    """Share the output head weight with the token embedding."""
    norm: str = "layernorm"
    """'layernorm' or 'rmsnorm'; both pre-norm."""
    bias: bool = False
    """Biases on the linear layers (norms always have a weight, LayerNorm also a bias)."""
    mlp_ratio: int = 4
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    vocab_multiple: int = 1
    """Embedding and head rows are ``vocab_size`` rounded up to a multiple of this (Megatron's
    make-vocab-size-divisible-by; `trainer.config` multiplies it by --tp). The padded rows are
    masked out of the logits, so never predicted (`trainer.gpu.vocab`)."""
    moe_experts: int = 0
    """Experts per MoE layer (0 = dense MLPs); see `trainer.moe`."""
    moe_topk: int = 2
    moe_every: int = 1
    """Layers 0, n, 2n, ... are MoE layers."""
    moe_router: str = "softmax"
    """Router score function: 'softmax' or 'sigmoid'."""
    moe_aux_loss_coeff: float = 1e-2
    moe_z_loss_coeff: float = 0.0
    moe_capacity_factor: float = 0.0
    """Tokens one expert keeps, as a multiple of its even share (0 = dropless)."""

    def __post_init__(self) -> None:
        # A ValueError here is turned into the trainer's ConfigError by trainer.config, which
        # knows the flag or file the value came from.
        positive = ("vocab_size", "n_layer", "n_head", "d_model", "seq_len", "mlp_ratio",
                    "vocab_multiple")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if (self.d_model // self.n_head) % 2:
            raise ValueError(f"head dim d_model/n_head ({self.d_model // self.n_head}) must be "
                             "even for rotary embeddings")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {self.norm!r}")
        from trainer.moe.checks import check_model  # trainer.moe builds on this module

        check_model(self)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and the head: vocab_size padded to vocab_multiple."""
        return padded_size(self.vocab_size, self.vocab_multiple)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: Named sizes for ``--model``. ``125m`` is GPT-2 small's shape (with a byte vocabulary);
#: ``gpt-124m`` and ``gpt-350m`` are GPT-2 small and medium with GPT-2's vocabulary size, padded
#: to a multiple of 128 x tp (`trainer.gpu.vocab`), the realistic sizes for GPU runs.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=64),
    "small": GPTConfig(n_layer=4, n_head=4, d_model=256, seq_len=256),
    "125m": GPTConfig(n_layer=12, n_head=12, d_model=768, seq_len=1024, tied=True),
    "gpt-124m": GPTConfig(vocab_size=GPT2_VOCAB, vocab_multiple=128, n_layer=12, n_head=12,
                          d_model=768, seq_len=1024),
    "gpt-350m": GPTConfig(vocab_size=GPT2_VOCAB, vocab_multiple=128, n_layer=24, n_head=16,
                          d_model=1024, seq_len=1024),
}


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (no mean subtraction, no bias)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def cross_entropy(logits_NV: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in at least fp32."""
    return F.cross_entropy(at_least_fp32(logits_NV), targets_N)


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
    """Rotate each (even, odd) pair of channels by its position's angle."""
    T = x_BHTK.shape[-2]
    cos, sin = cos[:T].to(x_BHTK.dtype), sin[:T].to(x_BHTK.dtype)
    x1, x2 = x_BHTK[..., 0::2], x_BHTK[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


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
        q, k, v = qkv[0], qkv[1], qkv[2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.core_runner(self.core, q, k, v)
        y_BTD = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_drop(self.proj(y_BTD))


class MLP(nn.Module):
    """fc (D -> ratio*D) -> GELU -> proj (ratio*D -> D)."""

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


def init_rule(name: str, n_layer: int) -> tuple[float, float]:
    """``(fill, std)`` of parameter ``name`` in `GPT.init_weights`: ``std`` 0 means the
    constant ``fill`` (biases 0, norm weights 1), otherwise N(0, std) from the init generator.
    Shared with `trainer.construction`, which initialises shards without the whole model."""
    if name.endswith("bias"):
        return 0.0, 0.0
    if ".ln" in name or name.startswith("ln_f"):
        return 1.0, 0.0
    return 0.0, 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02


class GPT(nn.Module):
    """Token ids (B, T) -> logits (B, T, V). Initialised deterministically from ``seed``."""

    def __init__(self, cfg: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        # torch's layer constructors draw their default init from the global RNG; fork it so
        # building a model never shifts the data or dropout streams of the caller.
        with torch.random.fork_rng(devices=[]):
            self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab_rows, cfg.d_model)
            self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
            if cfg.moe_experts:
                from trainer.moe.layer import install_moe  # trainer.moe builds on this module

                install_moe(self.blocks, cfg)
            self.ln_f: nn.Module | None = make_norm(cfg)
            self.head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_rows, bias=False)
        self.emb_drop = nn.Dropout(cfg.dropout)
        self.criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
        """(logits (N, V), targets (N,)) -> mean loss. Hook for tensor parallelism, whose
        head yields vocabulary-sharded logits."""
        self.vocab_start = 0
        """Vocabulary row of this model's first logit (parallelize sets it on a TP shard), for
        masking the padded rows (``vocab_multiple``)."""
        if cfg.tied:
            self.head.weight = self.tok_emb.weight
        cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_base)
        # Derived from the config, so not saved: a checkpoint holds only learned state.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not self.ln_f.weight.is_meta:  # a meta-device model: trainer.construction fills it
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 init from a private generator, in parameter-name order, so it is reproducible
        and independent of the global RNG: N(0, 0.02), residual projections scaled by
        1/sqrt(2 * n_layer), zero biases, unit norm weights."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            fill, std = init_rule(name, self.cfg.n_layer)
            if std:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:
                p.fill_(fill)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        h = self.emb_drop(self.tok_emb(idx_BT)) if self.tok_emb is not None else idx_BT
        for block in self.blocks.values():
            h = block(h, self.rope_cos, self.rope_sin)
        if self.ln_f is not None:
            h = self.ln_f(h)
        if self.head is None:
            return h
        return mask_padded_vocab(self.head(h), self.cfg.vocab_size, self.vocab_start)

    def loss(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy over every position of the batch."""
        logits = self(idx_BT)
        return self.criterion(logits.flatten(0, 1), targets_BT.flatten())

    def num_params(self) -> int:
        """Parameter count, a tied weight counted once."""
        return sum(p.numel() for p in self.parameters())

    def layers(self) -> Iterator[tuple[int, Block]]:
        """(global layer index, block) pairs of the layers this model (or stage) holds."""
        for key, block in self.blocks.items():
            yield int(key), block
