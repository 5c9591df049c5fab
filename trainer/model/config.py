"""The GPT's size and shape (`GPTConfig`, with its mixture-of-experts part `MoEConfig`) and the
named sizes of ``--model`` (`PRESETS`).

Everything that changes the parameter set or the math is a field here, declared with its help
text and bounds (`trainer.schema`): `trainer.config` turns the fields into flags (``--n-layer``,
``--moe-experts``) and TOML keys (``[model] n_layer``, ``[moe] experts``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from trainer.errors import ConfigError
from trainer.gpu.vocab import GPT2_VOCAB, padded_size
from trainer.model.llama_config import LLAMA3_VOCAB, LlamaShape
from trainer.schema import Section, option, section

NORMS = ("layernorm", "rmsnorm")
ARCHS = ("gpt", "llama")
"""Model families: `trainer.model.gpt` and `trainer.model.llama` (`trainer.model.family`)."""
FAMILY_NAMES = {"gpt": "GPT", "llama": "Llama"}
"""How a family is named in banners and plots."""
ROUTERS = ("softmax", "sigmoid")
"""The router's score functions (`trainer.parallel.expert.router`)."""


@dataclass(frozen=True, kw_only=True)
class MoEConfig(Section):
    """Mixture of experts (`trainer.parallel.expert`): which MLPs become experts, and how tokens
    are routed."""

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

    arch: str = option("gpt", "model family: gpt (GELU MLP, interleaved rotary) or llama "
                       "(SwiGLU, grouped-query attention, Hugging Face's rotary layout)",
                       choices=ARCHS)
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
    rope_theta: float = option(10000.0, "base (theta) of the rotary embedding frequencies",
                               above=0)
    norm_eps: float = option(1e-5, "epsilon of the norms", above=0)
    vocab_multiple: int = option(1, "pad the embedding and head rows to a multiple of this "
                                 "(times --tp); the padded rows are masked out of the logits",
                                 at_least=1)
    moe: MoEConfig = section(MoEConfig, "mixture of experts", table="moe")
    llama: LlamaShape = section(LlamaShape, "the Llama family's own fields (--arch llama)",
                                merge=True)

    def check(self) -> None:
        if self.d_model % self.n_head:
            raise ConfigError("invalid model configuration", f"--d-model {self.d_model}",
                              f"d_model ({self.d_model}) must be divisible by n_head "
                              f"({self.n_head})", "Change --d-model or --n-head")
        if self.head_dim % 2:
            raise ConfigError("invalid model configuration", f"--d-model {self.d_model}",
                              f"head dim d_model/n_head ({self.head_dim}) must be even for "
                              "rotary embeddings", "Change --d-model or --n-head")
        if self.arch == "llama":
            self._check_llama()
        elif self.llama != LlamaShape():
            changed = [f"--{name.replace('_', '-')}" for name, value in asdict(self.llama).items()
                       if value != getattr(LlamaShape(), name)]
            raise ConfigError("Llama options on a GPT model", ", ".join(changed),
                              "they shape the Llama family only", "Add --arch llama (or a "
                              "llama preset: --model llama-tiny), or drop them")

    def _check_llama(self) -> None:
        if self.norm != "rmsnorm" or self.bias:
            raise ConfigError("invalid Llama configuration", f"--norm {self.norm}"
                              + (" --bias" if self.bias else ""),
                              "a Llama model has RMSNorm and no biases",
                              "Pass --norm rmsnorm and no --bias (the llama presets do)")
        if self.n_head % self.kv_heads:
            raise ConfigError("invalid Llama configuration",
                              f"--n-head {self.n_head} --n-kv-head {self.llama.n_kv_head}",
                              "each key/value head must serve a whole number of query heads",
                              "Choose an --n-kv-head that divides --n-head")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``llama.n_kv_head`` for a Llama that sets it, else n_head."""
        return (self.llama.n_kv_head if self.arch == "llama" else 0) or self.n_head

    @property
    def hidden(self) -> int:
        """The MLP's hidden width: mlp_ratio·d_model (GPT), Llama's SwiGLU rule (llama)."""
        if self.arch == "llama":
            return self.llama.hidden(self.d_model, self.mlp_ratio)
        return self.mlp_ratio * self.d_model

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and the head: vocab_size padded to vocab_multiple."""
        return padded_size(self.vocab_size, self.vocab_multiple)

    def to_dict(self) -> dict[str, Any]:
        """Every field by its flag's name (``moe_experts``, ``n_kv_head``), as a checkpoint
        records it."""
        out = asdict(self)
        out.update({MoEConfig.flag_prefix + k: v for k, v in out.pop("moe").items()})
        out.update(out.pop("llama"))
        return out

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> GPTConfig:
        """The inverse of `to_dict`."""
        prefix = MoEConfig.flag_prefix
        moe = {k[len(prefix):]: v for k, v in fields.items() if k.startswith(prefix)}
        llama = {k: v for k, v in fields.items() if k in _LLAMA_FIELDS}
        rest = {k: v for k, v in fields.items()
                if not k.startswith(prefix) and k not in _LLAMA_FIELDS}
        return cls(**rest, moe=MoEConfig(**moe), llama=LlamaShape(**llama))


_LLAMA_FIELDS = frozenset(f.name for f in fields(LlamaShape))


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
    # Llama: llama-tiny for tests (byte vocabulary, 8 query and 2 key/value heads); llama3-1b
    # is Llama 3.2 1B and llama3-8b Llama 3 8B as published (Hugging Face's config.json of
    # meta-llama/Llama-3.2-1B and Meta-Llama-3-8B; 3.2 1B ties its embeddings).
    "llama-tiny": GPTConfig(arch="llama", norm="rmsnorm", tied=False, n_layer=2, n_head=8,
                            d_model=64, seq_len=64, llama=LlamaShape(n_kv_head=2,
                                                                     multiple_of=16)),
    "llama3-1b": GPTConfig(arch="llama", norm="rmsnorm", tied=True, vocab_size=LLAMA3_VOCAB,
                           vocab_multiple=128, n_layer=16, n_head=32, d_model=2048,
                           seq_len=8192, rope_theta=500000.0,
                           llama=LlamaShape(n_kv_head=8, ffn_multiplier=1.5, multiple_of=256,
                                            rope_scaling="llama3", rope_factor=32.0)),
    "llama3-8b": GPTConfig(arch="llama", norm="rmsnorm", tied=False, vocab_size=LLAMA3_VOCAB,
                           vocab_multiple=128, n_layer=32, n_head=32, d_model=4096,
                           seq_len=8192, rope_theta=500000.0,
                           llama=LlamaShape(n_kv_head=8, ffn_multiplier=1.3, multiple_of=1024)),
}
