"""The GPT's size and shape (`GPTConfig`) and the named sizes of ``--model`` (`PRESETS`).

Everything that changes the parameter set or the math is a field here; `trainer.config.options`
builds one from the flags and the ``[gpt]`` table of a TOML file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from trainer.gpu.vocab import GPT2_VOCAB, padded_size

NORMS = ("layernorm", "rmsnorm")


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
    make-vocab-size-divisible-by; `trainer.config.options` multiplies it by --tp). The padded
    rows are masked out of the logits, so never predicted (`trainer.gpu.vocab`)."""
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
        # A ValueError here is turned into the trainer's ConfigError by trainer.config.options,
        # which knows the flag or file the value came from.
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

