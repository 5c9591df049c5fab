"""The GPT's size and shape (`GPTConfig`, with its mixture-of-experts part `MoEConfig`) and the
named sizes of ``--model`` (`PRESETS`).

Everything that changes the parameter set or the math is a field here, declared with its help
text and bounds (`trainer.schema`): `trainer.config` turns the fields into flags (``--n-layer``,
``--moe-experts``) and TOML keys (``[model] n_layer``, ``[moe] experts``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from trainer.errors import ConfigError
from trainer.gpu.vocab import GPT2_VOCAB, padded_size
from trainer.schema import Section, option, section

NORMS = ("layernorm", "rmsnorm")
ROUTERS = ("softmax", "sigmoid")
"""The router's score functions (`trainer.moe.router`)."""


@dataclass(frozen=True, kw_only=True)
class MoEConfig(Section):
    """Mixture of experts (`trainer.moe`): which MLPs become experts, and how tokens are routed."""

    flag_prefix: ClassVar[str] = "moe_"

    experts: int = option(0, "experts per MoE layer (0 = dense MLPs)", at_least=0)
    topk: int = option(2, "experts each token is routed to", at_least=1)
    every: int = option(1, "layers 0, n, 2n, ... are MoE layers", at_least=1)
    router: str = option("softmax", "router score function: softmax or sigmoid",
                         choices=ROUTERS)
    aux_loss_coeff: float = option(1e-2, "weight of the Switch load-balancing loss (added to "
                                   "the gradient, not to the logged loss)", at_least=0)
    z_loss_coeff: float = option(0.0, "weight of the router z-loss", at_least=0)
    capacity_factor: float = option(0.0, "tokens one expert keeps, as a multiple of its even "
                                    "share; the lowest scores are dropped (0 = dropless)",
                                    at_least=0)

    def check(self) -> None:
        if self.experts and self.topk > self.experts:
            raise ConfigError("invalid option", f"--moe-topk {self.topk}",
                              f"a token cannot go to more than the {self.experts} experts",
                              f"Pass --moe-topk between 1 and {self.experts}")


@dataclass(frozen=True, kw_only=True)
class GPTConfig(Section):
    """Model size and shape. Everything that changes the parameter set or the math is here."""

    vocab_size: int = option(256, "vocabulary size (256: byte-level, one token per byte)",
                             at_least=1)
    n_layer: int = option(2, "transformer blocks", at_least=1)
    n_head: int = option(2, "attention heads", at_least=1)
    d_model: int = option(64, "model width", at_least=1)
    seq_len: int = option(64, "maximum (and training) context length; the RoPE tables are "
                          "built for it", at_least=1)
    dropout: float = option(0.0, "dropout probability", at_least=0, below=1)
    tied: bool = option(True, "share the output head weight with the token embedding")
    norm: str = option("layernorm", "layernorm or rmsnorm (both pre-norm)", choices=NORMS)
    bias: bool = option(False, "biases on the linear layers (norms always have a weight, "
                        "LayerNorm also a bias)")
    mlp_ratio: int = option(4, "MLP width as a multiple of d_model", at_least=1)
    rope_base: float = option(10000.0, "base of the rotary embedding frequencies", above=0)
    norm_eps: float = option(1e-5, "epsilon of the norms", above=0)
    vocab_multiple: int = option(1, "pad the embedding and head rows to a multiple of this "
                                 "(times --tp); the padded rows are masked out of the logits",
                                 at_least=1)
    moe: MoEConfig = section(MoEConfig, "mixture of experts", table="moe")

    def check(self) -> None:
        if self.d_model % self.n_head:
            raise ConfigError("invalid model configuration", f"--d-model {self.d_model}",
                              f"d_model ({self.d_model}) must be divisible by n_head "
                              f"({self.n_head})", "Change --d-model or --n-head")
        if self.head_dim % 2:
            raise ConfigError("invalid model configuration", f"--d-model {self.d_model}",
                              f"head dim d_model/n_head ({self.head_dim}) must be even for "
                              "rotary embeddings", "Change --d-model or --n-head")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and the head: vocab_size padded to vocab_multiple."""
        return padded_size(self.vocab_size, self.vocab_multiple)

    def to_dict(self) -> dict[str, Any]:
        """Every field by its flag's name (``moe_experts``), as a checkpoint records it."""
        out = asdict(self)
        out.update({MoEConfig.flag_prefix + k: v for k, v in out.pop("moe").items()})
        return out

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> GPTConfig:
        """The inverse of `to_dict`."""
        prefix = MoEConfig.flag_prefix
        moe = {k[len(prefix):]: v for k, v in fields.items() if k.startswith(prefix)}
        return cls(**{k: v for k, v in fields.items() if not k.startswith(prefix)},
                   moe=MoEConfig(**moe))


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
