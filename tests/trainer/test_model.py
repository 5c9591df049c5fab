"""The single-device GPT: deterministic init, causality, shapes, naming for parallelize."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tests.support.numerics import U32, reduction_rtol
from trainer.errors import ConfigError
from trainer.model.config import PRESETS, GPTConfig
from trainer.model.gpt import GPT
from trainer.model.layers import apply_rope, rope_tables

TINY = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16)


def tokens(batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_same_seed_builds_bit_identical_weights_and_another_seed_does_not() -> None:
    a, b, c = GPT(TINY, seed=5), GPT(TINY, seed=5), GPT(TINY, seed=6)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_init_leaves_the_global_random_stream_alone() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    GPT(TINY, seed=1)
    assert torch.equal(torch.rand(3), expected)


def test_logits_have_vocab_width_and_initial_loss_is_near_uniform() -> None:
    model = GPT(TINY)
    x = tokens()
    assert model(x).shape == (2, 16, 256)
    assert abs(model.loss(x, tokens(seed=1)).item() - math.log(256)) < 0.2


def test_attention_is_causal_a_future_token_does_not_change_earlier_logits() -> None:
    model = GPT(TINY).eval()
    x = tokens()
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 256
    out_x, out_y = model(x), model(y)
    assert torch.equal(out_x[:, :10], out_y[:, :10])
    assert not torch.allclose(out_x[:, 10:], out_y[:, 10:])


def test_tied_head_is_the_embedding_and_untied_head_is_its_own_parameter() -> None:
    tied, untied = GPT(TINY), GPT(replace(TINY, tied=False))
    assert tied.head.weight is tied.tok_emb.weight
    assert untied.head.weight is not untied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == 256 * 32


def test_layers_carry_the_names_tensor_and_pipeline_parallelism_replace() -> None:
    names = {n for n, _ in GPT(TINY).named_parameters()}
    for part in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj", "ln1", "ln2"):
        assert f"blocks.1.{part}.weight" in names
    assert {"tok_emb.weight", "ln_f.weight"} <= names


def test_a_stage_without_some_layers_keeps_global_layer_names_and_runs_on_hidden_states() -> None:
    model = GPT(TINY)
    del model.blocks["0"]
    model.tok_emb = None
    assert [i for i, _ in model.layers()] == [1]
    assert any(n.startswith("blocks.1.") for n, _ in model.named_parameters())
    assert model(torch.randn(2, 16, 32)).shape == (2, 16, 256)


def test_rmsnorm_variant_uses_rms_norm_layers_and_trains() -> None:
    model = GPT(replace(TINY, norm="rmsnorm", bias=True))
    assert type(model.blocks["0"].ln1).__name__ == "RMSNorm"
    model.loss(tokens(), tokens(seed=1)).backward()
    assert model.blocks["0"].mlp.fc.bias.grad is not None


def test_rotary_embedding_keeps_vector_norms_and_depends_on_relative_position() -> None:
    cos, sin = rope_tables(16, 8, 10000.0)
    q, k = torch.randn(1, 1, 1, 8).expand(1, 1, 16, 8), torch.randn(1, 1, 1, 8).expand(1, 1, 16, 8)
    rq, rk = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    scores = (rq[0, 0, 3:] * rk[0, 0, :-3]).sum(-1)  # every pair three positions apart
    # fp32: each score is a sum of 8 products of rotated channels, each rotation 2 products with
    # rounded table entries, so two scores differ by at most the bound for 8 + 2 terms.
    bound = reduction_rtol(8 + 2, U32) * float((q[0, 0, 0].abs() * k[0, 0, 0].abs()).sum()) * 2
    torch.testing.assert_close(scores, scores[:1].expand_as(scores), rtol=0, atol=bound)


def test_a_few_steps_on_one_batch_lower_the_loss() -> None:
    model = GPT(TINY)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = tokens(), tokens(seed=1)
    first = model.loss(x, y)
    for _ in range(5):
        optimizer.zero_grad()
        model.loss(x, y).backward()
        optimizer.step()
    assert model.loss(x, y).item() < first.item() - 0.5


@pytest.mark.parametrize("bad, message", [
    ({"n_head": 3}, "divisible by n_head"),
    ({"n_head": 32}, "must be even"),
    ({"norm": "batchnorm"}, r"\[--norm batchnorm\]: must be one of layernorm, rmsnorm"),
    ({"dropout": 1.0}, r"\[--dropout 1.0\]: must be below 1"),
    ({"n_layer": 0}, r"\[--n-layer 0\]: must be >= 1"),
])
def test_invalid_model_shapes_are_rejected_with_the_reason(bad: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        replace(TINY, **bad)


def test_presets_are_valid_and_grow_in_size() -> None:
    sizes = [GPT(PRESETS[name]).num_params() for name in ("tiny", "small")]
    assert sizes[0] < sizes[1]
    assert PRESETS["125m"].d_model == 768 and PRESETS["125m"].n_layer == 12
