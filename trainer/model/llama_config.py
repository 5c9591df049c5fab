"""The Llama family's own shape fields (`LlamaShape`, the ``llama`` section of `GPTConfig`).

A Llama model (``arch = "llama"``) is the GPT's decoder (token embedding, pre-norm blocks, final
norm, head) with other parts inside the blocks (`trainer.model.llama`): RMSNorm, a SwiGLU MLP,
grouped-query attention and rotary embeddings in Hugging Face's half-split layout, no biases
and, by default, an untied head. What only Llama has is declared here; the presets
(``llama-tiny``, ``llama3-1b``, ``llama3-8b``) are in `trainer.model.config`.

The MLP's hidden size follows Llama's reference code (meta-llama/llama3 ``model.py``,
``FeedForward``): ``h = int(2 * mlp_ratio * d_model / 3)``, times ``ffn_multiplier``, rounded up
to a multiple of ``multiple_of``. Llama 3 8B: 4096 -> 10922 -> x1.3 = 14198 -> 14336. A
checkpoint imported from Hugging Face states its ``intermediate_size``, kept as ``ffn_hidden``.

Llama 3 frequency scaling (``rope_scaling = "llama3"``, Hugging Face's ``rope_type: llama3``)
divides the rotary frequencies whose wavelength exceeds ``rope_original_seq_len /
rope_low_freq_factor`` by ``rope_factor``, keeps those shorter than ``rope_original_seq_len /
rope_high_freq_factor``, and blends linearly in between.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.errors import ConfigError
from trainer.schema import Section, option

ROPE_SCALINGS = ("none", "llama3")


@dataclass(frozen=True, kw_only=True)
class LlamaShape(Section):
    """The fields of a Llama model that a GPT does not have (used with --arch llama)."""

    n_kv_head: int = option(0, "key/value heads of grouped-query attention, each read by "
                            "n_head / n_kv_head query heads (0 = n_head: plain multi-head)",
                            at_least=0)
    ffn_multiplier: float = option(1.0, "Llama's ffn_dim_multiplier: scales the SwiGLU hidden "
                                   "size before rounding", above=0)
    multiple_of: int = option(256, "the SwiGLU hidden size is rounded up to a multiple of this",
                              at_least=1)
    ffn_hidden: int = option(0, "the SwiGLU hidden size itself, instead of Llama's rule "
                             "(Hugging Face's intermediate_size; 0 = the rule)", at_least=0)
    rope_scaling: str = option("none", "rotary frequency scaling: none or llama3 (Llama 3.1's)",
                               choices=ROPE_SCALINGS)
    rope_factor: float = option(8.0, "llama3 rope scaling: divisor of the low frequencies",
                                above=0)
    rope_low_freq_factor: float = option(1.0, "llama3 rope scaling: low_freq_factor", above=0)
    rope_high_freq_factor: float = option(4.0, "llama3 rope scaling: high_freq_factor", above=0)
    rope_original_seq_len: int = option(8192, "llama3 rope scaling: the context the model was "
                                        "first trained at (original_max_position_embeddings)",
                                        at_least=1)

    def check(self) -> None:
        if self.rope_scaling != "none" and self.rope_low_freq_factor >= self.rope_high_freq_factor:
            raise ConfigError("invalid option", f"--rope-low-freq-factor "
                              f"{self.rope_low_freq_factor}", "it must be below "
                              f"--rope-high-freq-factor ({self.rope_high_freq_factor})",
                              "Pass factors as the model was trained with (Llama 3.1: 1 and 4)")

    def hidden(self, d_model: int, mlp_ratio: int) -> int:
        """The SwiGLU hidden size: ``ffn_hidden``, else Llama's rule."""
        if self.ffn_hidden:
            return self.ffn_hidden
        h = int(2 * mlp_ratio * d_model / 3)
        h = int(self.ffn_multiplier * h)
        return -(-h // self.multiple_of) * self.multiple_of


#: Llama 3's tokenizer (tiktoken-based BPE): 128,000 tokens plus 256 special ones.
LLAMA3_VOCAB = 128256
