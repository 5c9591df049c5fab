"""The Llama presets have the published shapes, and the model's parts behave as Llama's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainer.config.options import parse_args
from trainer.errors import ConfigError
from trainer.model.config import PRESETS, GPTConfig
from trainer.model.llama import Llama, apply_rope_half, inv_frequencies, llama_rope_tables
from trainer.model.llama_config import LlamaShape


@pytest.mark.parametrize(("preset", "hidden", "params"), [
    # Parameter counts of meta-llama/Meta-Llama-3-8B and Llama-3.2-1B (tied embeddings).
    ("llama3-8b", 14336, 8_030_261_248),
    ("llama3-1b", 8192, 1_235_814_400),
])
def test_the_presets_have_the_published_sizes(preset: str, hidden: int, params: int) -> None:
    cfg = PRESETS[preset]
    assert cfg.hidden == hidden
    with torch.device("meta"):
        assert Llama(cfg).num_params() == params


def test_grouped_query_attention_shares_each_kv_head_among_its_query_heads() -> None:
    cfg = PRESETS["llama-tiny"]
    model = Llama(cfg, seed=0)
    attn = model.blocks["0"].attn
    B, T, K = 1, 5, cfg.head_dim
    q = torch.randn(B, cfg.n_head, T, K)
    kv = torch.randn(2, B, cfg.kv_heads, T, K)
    repeated = [t.repeat_interleave(cfg.n_head // cfg.kv_heads, dim=1) for t in kv]
    torch.testing.assert_close(attn.core(q, kv[0], kv[1]), attn.core(q, *repeated))


def test_rotary_embedding_rotates_the_two_halves_of_each_head() -> None:
    cfg = GPTConfig(arch="llama", norm="rmsnorm", n_head=1, d_model=4, seq_len=3)
    angles = torch.outer(torch.arange(3.0, dtype=torch.float64), inv_frequencies(cfg))
    x = torch.tensor([1.0, 0.0, 0.0, 0.0]).expand(1, 3, 1, 4)  # (B, T, H, K)
    out = apply_rope_half(x, *llama_rope_tables(cfg))
    # Channel 0 pairs with channel 2 (Hugging Face's rotate_half), not with channel 1.
    torch.testing.assert_close(out[0, :, 0, 2], angles[:, 0].sin().float())
    assert not out[0, :, 0, 1].any()


def test_llama3_scaling_keeps_high_and_divides_low_frequencies() -> None:
    plain = GPTConfig(arch="llama", norm="rmsnorm", n_head=1, d_model=128, rope_theta=500000.0)
    scaled = replace(plain, llama=LlamaShape(rope_scaling="llama3", rope_factor=8.0))
    a, b = inv_frequencies(plain), inv_frequencies(scaled)
    assert b[0] == a[0]  # wavelength 2π, far below 8192 / 4
    assert torch.isclose(b[-1], a[-1] / 8, rtol=1e-12)  # wavelength far above 8192


@pytest.mark.parametrize(("fields", "message"), [
    ({"llama": LlamaShape(n_kv_head=3)}, "each key/value head must serve a whole number"),
    ({"bias": True}, "a Llama model has RMSNorm and no biases"),
    ({"arch": "gpt", "norm": "layernorm"}, r"Llama options on a GPT model \[--n-kv-head, "
                                           r"--multiple-of\]"),
])
def test_an_impossible_llama_is_refused(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        replace(PRESETS["llama-tiny"], **fields)


def test_llama_flags_are_options_of_the_trainer() -> None:
    cfg = parse_args(["--model", "llama-tiny", "--n-kv-head", "4", "--rope-theta", "5e5",
                      "--ffn-multiplier", "1.3", "--multiple-of", "32"])
    assert cfg.gpt.arch == "llama" and cfg.gpt.kv_heads == 4 and cfg.gpt.rope_theta == 5e5
    assert cfg.gpt.hidden == 224  # int(1.3 * int(2 * 4 * 64 / 3)) = 221, up to a multiple of 32
