"""ZeRO-3 construction straight into shards (`trainer.construction.shards`), in one process:
every DP rank's shards, built from the meta device, put together are the serial model's
initial weights bit for bit, and construction never holds more than the shards plus one
parameter's value (the construction's own byte accounting), never the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.numerics import float64
from trainer.config.options import make_config
from trainer.construction import build_rank_model, meta_rank_model
from trainer.construction.shards import materialise_shards
from trainer.hf.folder import load_rank_slices, rank_slices, read_folder
from trainer.model.family import build_model

GPT = {"n_layer": 8, "n_head": 2, "d_model": 32, "seq_len": 32}
DP = 4


def built(rank: int, dp: int = DP, **gpt: object):  # noqa: ANN201 - (model, UnitShards)
    cfg = make_config({"model": "tiny", "seed": 5}, {**GPT, **gpt}).gpt
    model = meta_rank_model(cfg, 5, device=torch.device("cpu"))
    return model, materialise_shards(model, 5, tp_rank=0, tp_size=1,
                                     device=torch.device("cpu"), dp_size=dp, dp_rank=rank)


@pytest.mark.parametrize("tied", [True, False])
def test_the_shards_of_every_rank_put_together_are_the_serial_initial_weights(
        tied: bool) -> None:
    with float64():
        serial = build_model(make_config({"model": "tiny", "seed": 5},
                                         {**GPT, "tied": tied}).gpt, seed=5)
        ranks = [built(r, tied=tied) for r in range(DP)]
    model, first = ranks[0]
    named = [(n, p) for n, p in model.named_parameters()][::-1]
    want = dict(serial.named_parameters())
    for k, b in enumerate(first.layout.buckets):
        whole = torch.cat([units.shards[k] for _, units in ranks])
        for i in b.params:
            name, p = named[i]
            at = first.layout.offsets[i] - b.start
            assert torch.equal(whole[at:at + p.numel()], want[name].detach().reshape(-1)), name


def test_no_unit_is_held_whole_after_construction_and_the_parameters_view_the_units() -> None:
    model, units = built(0)
    assert [f.untyped_storage().nbytes() for f in units.full] == [0] * len(units.full)
    assert not any(p.is_meta for p in model.parameters())
    named = [p for _, p in model.named_parameters()][::-1]
    full, b = units.full[1], units.layout.buckets[1]  # a block: gathered by hand here
    full.untyped_storage().resize_(full.numel() * full.element_size())
    full.fill_(7.0)
    assert all(bool((named[i] == 7.0).all()) for i in b.params)
    full.untyped_storage().resize_(0)


def test_construction_holds_the_shards_and_one_parameter_never_the_model() -> None:
    model, units = built(0)
    size = torch.get_default_dtype().itemsize
    shards = sum(s.numel() * s.element_size() for s in units.shards)
    params = [p.numel() * size for p in model.parameters()]
    whole = sum(params)
    assert units.peak_bytes <= shards + max(params)
    assert shards == pytest.approx(whole / DP, rel=0.02)
    blocks = [(b.end - b.start) * size for b in units.layout.buckets]
    assert units.peak_bytes < whole / 2 and units.peak_bytes < shards + sum(sorted(blocks)[-2:])


def test_a_hugging_face_folder_loads_straight_into_the_shards(tmp_path: Path) -> None:
    """``--init-from-hf`` under ZeRO-3: each parameter's slice is read on its own and only
    the shards keep it; put together they are what the plain load gives a whole model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(1)
    LlamaForCausalLM(hf).save_pretrained(tmp_path)
    folder = read_folder(tmp_path)
    cpu = torch.device("cpu")
    whole = build_rank_model(folder.cfg, 0, device=cpu)
    load_rank_slices(whole, folder, 0, 1)
    want = dict(whole.named_parameters())
    ranks = []
    for rank in range(2):
        model = meta_rank_model(folder.cfg, 0, device=cpu)
        ranks.append((model, materialise_shards(model, 0, tp_rank=0, tp_size=1, device=cpu,
                                                dp_size=2, dp_rank=rank,
                                                values=rank_slices(model, folder, 0, 1))))
    model, first = ranks[0]
    named = [(n, p) for n, p in model.named_parameters()][::-1]
    for k, b in enumerate(first.layout.buckets):
        flat = torch.cat([units.shards[k] for _, units in ranks])
        for i in b.params:
            name, p = named[i]
            at = first.layout.offsets[i] - b.start
            assert torch.equal(flat[at:at + p.numel()], want[name].detach().reshape(-1)), name
    params = [p.numel() * p.element_size() for p in whole.parameters()]
    shards = sum(s.numel() * s.element_size() for s in first.shards)
    assert first.peak_bytes <= shards + max(params) and first.peak_bytes < sum(params) / 1.5
