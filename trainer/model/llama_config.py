"""The Llama family's size and shape (`LlamaConfig`) and its ``--model`` presets.

A Llama model is the GPT's decoder (token embedding, pre-norm blocks, final norm, head) with
other parts inside the blocks (`trainer.model.llama`): RMSNorm, a SwiGLU MLP, grouped-query
attention and rotary embeddings in Hugging Face's half-split layout, no biases and, by default,
an untied head. `LlamaConfig` therefore extends `GPTConfig` with the fields that only Llama has,
so everything that reads a model config (pipeline partition, FLOPs, vocabulary padding) reads
this one too.

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

from trainer.model.config import GPTConfig

ROPE_SCALINGS = ("none", "llama3")


@dataclass(frozen=True, kw_only=True)
class LlamaConfig(GPTConfig):
    """A Llama-family model. The GPT fields keep their meaning; the defaults differ where Llama
    differs (RMSNorm, untied head, no biases)."""

    norm: str = "rmsnorm"
    tied: bool = False
    n_kv_head: int = 0
    """Key/value heads of grouped-query attention; each serves n_head / n_kv_head query heads.
    0: one per query head (plain multi-head attention)."""
    ffn_multiplier: float = 1.0
    """Llama's ``ffn_dim_multiplier``: scales the MLP's hidden size before rounding."""
    multiple_of: int = 256
    """The MLP's hidden size is rounded up to a multiple of this."""
    ffn_hidden: int = 0
    """The MLP's hidden size when given (> 0), instead of Llama's rule; Hugging Face's
    ``intermediate_size``."""
    rope_scaling: str = "none"
    """'none' or 'llama3' (Llama 3.1's frequency scaling, with the four fields below)."""
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_seq_len: int = 8192
    """The context length the model was first trained at (``original_max_position_embeddings``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_kv_head < 0 or self.n_head % self.kv_heads:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head "
                             f"({self.n_kv_head}; 0 means n_head)")
        if self.multiple_of < 1 or self.ffn_hidden < 0 or not self.ffn_multiplier > 0:
            raise ValueError("multiple_of must be >= 1, ffn_hidden >= 0 and ffn_multiplier > 0, "
                             f"got {self.multiple_of}, {self.ffn_hidden}, {self.ffn_multiplier}")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling must be one of {', '.join(ROPE_SCALINGS)}, got "
                             f"{self.rope_scaling!r}")
        if self.rope_scaling != "none" and not (
                self.rope_factor > 0 and self.rope_original_seq_len > 0
                and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
            raise ValueError("llama3 rope scaling needs rope_factor > 0, rope_original_seq_len "
                             "> 0 and 0 < rope_low_freq_factor < rope_high_freq_factor")
        if self.norm != "rmsnorm" or self.bias:
            raise ValueError("a Llama model has RMSNorm and no biases (norm='rmsnorm', "
                             "bias=False)")

    @property
    def kv_heads(self) -> int:
        """Key/value heads (``n_kv_head``, or ``n_head`` when it is 0)."""
        return self.n_kv_head or self.n_head

    @property
    def hidden(self) -> int:
        """The SwiGLU MLP's hidden size (``ffn_hidden``, else Llama's rule)."""
        if self.ffn_hidden:
            return self.ffn_hidden
        h = int(2 * self.mlp_ratio * self.d_model / 3)
        h = int(self.ffn_multiplier * h)
        return -(-h // self.multiple_of) * self.multiple_of


#: Llama 3's tokenizer (tiktoken-based BPE): 128,000 tokens plus 256 special ones.
LLAMA3_VOCAB = 128256

#: ``llama-tiny`` is for tests (byte vocabulary, GQA with 8 query and 2 key/value heads);
#: ``llama3-1b`` is Llama 3.2 1B and ``llama3-8b`` Llama 3 8B, as published (Hugging Face's
#: ``config.json`` of meta-llama/Llama-3.2-1B and Meta-Llama-3-8B).
LLAMA_PRESETS: dict[str, LlamaConfig] = {
    "llama-tiny": LlamaConfig(n_layer=2, n_head=8, n_kv_head=2, d_model=64, seq_len=64,
                              multiple_of=16),
    "llama3-1b": LlamaConfig(vocab_size=LLAMA3_VOCAB, vocab_multiple=128, n_layer=16,
                             n_head=32, n_kv_head=8, d_model=2048, ffn_multiplier=1.5,
                             multiple_of=256, seq_len=8192, rope_base=500000.0, tied=True,
                             rope_scaling="llama3", rope_factor=32.0),
    "llama3-8b": LlamaConfig(vocab_size=LLAMA3_VOCAB, vocab_multiple=128, n_layer=32,
                             n_head=32, n_kv_head=8, d_model=4096, ffn_multiplier=1.3,
                             multiple_of=1024, seq_len=8192, rope_base=500000.0),
}
