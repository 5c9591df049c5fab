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

The model's own hooks, plain attributes that `trainer.parallel.tensor.parallelize` sets:
``GPT.criterion`` (the loss on the head's logits) and ``GPT.vocab_start``, the vocabulary row of
the first logit, which masks padded rows on a shard; the layers' hooks are in
`trainer.model.layers`. All default to the serial behaviour.

One place computes the logits and the loss for every layout: `GPT.logits` (final norm, head,
the padded vocabulary rows masked to -inf) and `GPT.head_loss` (the criterion on them). The
serial model, a TP shard, the last pipeline stage (`trainer.parallel.pipeline.stages`) and
validation
all call them, so a padded vocabulary is the same model on each (`trainer.gpu.vocab`).

A padded vocabulary also starts as the same model: `GPT.init_weights` draws only the real rows
of the embedding and the head (`drawn_rows`) and leaves the padded rows at zero, so the padding
(which follows tp) shifts no draw and every real weight is the unpadded model's, whatever the
layout.

Shape legend: B batch, T sequence, D d_model, H heads, K head dim (D/H), V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from trainer.gpu.vocab import mask_padded_vocab
from trainer.model.config import GPTConfig
from trainer.model.layers import (
    MLP,
    Attention,
    Block,
    make_norm,
    plain_qkv,
    rope_tables,
    rotary_qkv,
)
from trainer.model.linear import Linear, use_plain_linears
from trainer.model.precision import at_least_fp32


def cross_entropy(logits_NV: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in at least fp32."""
    return F.cross_entropy(at_least_fp32(logits_NV), targets_N)


def init_rule(name: str, n_layer: int) -> tuple[float, float]:
    """``(fill, std)`` of parameter ``name`` in `GPT.init_weights`: ``std`` 0 means the
    constant ``fill`` (biases 0, norm weights 1), otherwise N(0, std) from the init generator.
    Shared with `trainer.construction`, which initialises shards without the whole model."""
    if name.endswith("bias"):
        return 0.0, 0.0
    if ".ln" in name or name.startswith("ln_f"):
        return 1.0, 0.0
    return 0.0, 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02


VOCAB_WEIGHTS = frozenset({"tok_emb.weight", "head.weight"})
"""The parameters with one row per vocabulary entry (the padded ones included)."""


def drawn_rows(name: str, rows: int, cfg: GPTConfig) -> int:
    """How many of the ``rows`` rows of parameter ``name`` `GPT.init_weights` draws (from the
    first): the real vocabulary's of the embedding and the head, whose padded rows start at
    zero; every row of any other weight. Shared with `trainer.construction`."""
    return min(rows, cfg.vocab_size) if name in VOCAB_WEIGHTS else rows


class GPT(nn.Module):
    """Token ids (B, T) -> logits (B, T, V). Initialised deterministically from ``seed``."""

    rope_cos: torch.Tensor
    """The rotary tables (T, K/2): buffers, registered in ``__init__``."""
    rope_sin: torch.Tensor

    def __init__(self, cfg: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        # torch's layer constructors draw their default init from the global RNG; fork it so
        # building a model never shifts the data or dropout streams of the caller.
        with torch.random.fork_rng(devices=[]):
            self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab_rows, cfg.d_model)
            self.blocks = nn.ModuleDict({str(i): self.make_block(cfg)
                                         for i in range(cfg.n_layer)})
            if cfg.moe.experts:
                from trainer.parallel.expert.layer import (
                    install_moe,  # trainer.parallel.expert builds on this module
                )

                install_moe(self.blocks, cfg, self.make_mlp)
            self.ln_f: nn.Module | None = self.make_norm(cfg)
            self.head: nn.Linear | None = Linear(cfg.d_model, cfg.vocab_rows, bias=False)
        self.emb_drop = nn.Dropout(cfg.dropout)
        self.criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
        """(logits (N, V), targets (N,)) -> mean loss. Hook for tensor parallelism, whose
        head yields vocabulary-sharded logits."""
        self.vocab_start = 0
        """Vocabulary row of this model's first logit (parallelize sets it on a TP shard), for
        masking the padded rows (``vocab_multiple``)."""
        if cfg.tied:
            self.head.weight = self.tok_emb.weight
        cos, sin = self.rope_tables(cfg)
        # Derived from the config, so not saved: a checkpoint holds only learned state.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not self.ln_f.weight.is_meta:  # a meta-device model: trainer.construction fills it
            self.init_weights(seed)

    # The family's parts: `trainer.model.llama.Llama` overrides these four.
    make_block = staticmethod(Block)
    """The block of one layer."""
    make_mlp: Callable[[GPTConfig], nn.Module] = staticmethod(MLP)
    """The dense MLP (each expert of a mixture-of-experts layer is one)."""
    make_norm = staticmethod(make_norm)
    """The final norm."""

    @staticmethod
    def rope_tables(cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables the blocks get (derived from the config, so never saved)."""
        return rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 init from a private generator, in parameter-name order, so it is reproducible
        and independent of the global RNG: N(0, 0.02), residual projections scaled by
        1/sqrt(2 * n_layer), zero biases, unit norm weights; padded vocabulary rows zero, never
        drawn (`drawn_rows`)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            fill, std = init_rule(name, self.cfg.n_layer)
            if not std:
                p.fill_(fill)
                continue
            rows = drawn_rows(name, p.shape[0], self.cfg)
            p[:rows].copy_(torch.randn((rows, *p.shape[1:]), generator=gen) * std)
            p[rows:].zero_()

    def forward(self, idx_BT: torch.Tensor, docs_BT: torch.Tensor | None = None
                ) -> torch.Tensor:
        h = self.hidden(idx_BT, docs_BT)
        return h if self.head is None else self.logits(h)

    def hidden(self, idx_BT: torch.Tensor, docs_BT: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The last block's output (B, T, D) for token ids, or for a received activation when
        this model (a pipeline stage) has no embedding. ``docs_BT``: the window's document ids
        under ``--document-mask`` (`trainer.model.documents`; the whole window's, also when
        this rank holds a part of it), None for attention over the whole causal window."""
        h = self.embed(idx_BT) if self.tok_emb is not None else idx_BT
        for block in self.blocks.values():
            h = block(h, self.rope_cos, self.rope_sin, docs_BT)
        return h

    def embed(self, idx_BT: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> the first block's input (B, T, D)."""
        h: torch.Tensor = self.emb_drop(cast(nn.Embedding, self.tok_emb)(idx_BT))
        return h

    def logits(self, h_BTD: torch.Tensor) -> torch.Tensor:
        """The last block's output -> logits (B, T, V; this shard's rows under TP), the padded
        vocabulary rows at -inf so that they are never predicted and get no gradient."""
        head, ln_f = cast(nn.Linear, self.head), cast(nn.Module, self.ln_f)  # a last stage's
        return mask_padded_vocab(head(ln_f(h_BTD)), self.cfg.vocab_size,
                                 self.vocab_start)

    def head_loss(self, h_BTD: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy of the last block's output over every position: the
        loss of every layout (`loss`, the last pipeline stage, validation)."""
        return self.criterion(self.logits(h_BTD).flatten(0, 1), targets_BT.flatten())

    def loss(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor,
             docs_BT: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross entropy over every position of the batch."""
        return self.head_loss(self.hidden(idx_BT, docs_BT), targets_BT)

    def use_plain_ops(self, plain: bool) -> None:
        """Split and rotate q, k, v and multiply the linears in plain torch ops (True: for
        tracers such as torch.compile and vmap, which cannot see into the fused `RotaryQKV` or
        the oneDNN linears of `trainer.model.linear`) or fused (False, the default)."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.split_qkv = plain_qkv if plain else rotary_qkv
        use_plain_linears(self, plain)

    def num_params(self) -> int:
        """Parameter count, a tied weight counted once."""
        return sum(p.numel() for p in self.parameters())

    def layers(self) -> Iterator[tuple[int, Block]]:
        """(global layer index, block) pairs of the layers this model (or stage) holds."""
        for key, block in self.blocks.items():
            yield int(key), cast(Block, block)
