"""ZeRO-3 construction straight into shards (`trainer.construction.shards`), in one process:
every DP rank's shards, built from the meta device, put together are the serial model's
initial weights bit for bit, and construction never holds more than the shards plus one
parameter's value (the construction's own byte accounting), never the model.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.numerics import float64
from trainer.config.options import make_config
from trainer.construction import meta_rank_model
from trainer.construction.shards import materialise_shards
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
