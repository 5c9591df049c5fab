"""The pure core of per-rank construction, in one process: the serial initialisation's random
numbers drawn in pieces are the very numbers ``torch.randn`` draws whole, a shard cut from the
stream equals `shard_tensor` of the whole, and a model built on the meta device and filled is
bit-identical to the serial model (whole, and as pipeline stages). The tensor-parallel layouts
run over MPI in tests/trainer/test_activations.py."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from tests.support.numerics import float64
from trainer.construction import build_rank_model
from trainer.construction.init_stream import normal_pieces, shard_of_stream
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.parallel.pipeline.partition import StageLayout
from trainer.parallel.tensor import ShardSpec, shard_tensor

CPU = torch.device("cpu")
#: Below one block of 16, whole blocks, a tail of 1 and 15, more than one piece.
SIZES = [1, 15, 16, 17, 31, 32, 47, 160, 1003, 4096 + 5]
DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("piece", [32, 1 << 16])
def test_the_pieces_are_the_numbers_torch_randn_draws_whole(n: int, dtype: torch.dtype,
                                                            piece: int) -> None:
    whole_gen, piece_gen = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    whole = torch.randn(n, generator=whole_gen, dtype=dtype)
    pieces = list(normal_pieces(n, piece_gen, dtype, piece))
    assert max(p.numel() for p in pieces) <= max(piece, 16) + 15
    assert torch.equal(torch.cat(pieces), whole)
    # ... and leave the generator where the whole draw does, for the next weight.
    assert torch.equal(torch.randn(40, generator=piece_gen, dtype=dtype),
                       torch.randn(40, generator=whole_gen, dtype=dtype))


@pytest.mark.parametrize(("shape", "spec"), [
    ((24, 5), ShardSpec(0)), ((24, 5), ShardSpec(0, 3)), ((6, 8), ShardSpec(1)),
    ((7, 3), None), ((12,), ShardSpec(0))], ids=str)
@pytest.mark.parametrize("size", [2, 4])
def test_a_shard_cut_from_the_stream_equals_the_shard_of_the_whole(
        shape: tuple[int, ...], spec: ShardSpec | None, size: int) -> None:
    whole = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    for rank in range(size):
        pieces = iter(whole.flatten().split(16))  # rows straddle the pieces
        got = shard_of_stream(pieces, whole.shape, spec, rank, size)
        want = whole if spec is None else shard_tensor(whole, rank, size, spec)
        assert torch.equal(got, want), rank


CFGS = [GPTConfig(n_layer=2, n_head=2, d_model=40, seq_len=16, vocab_size=250),
        GPTConfig(n_layer=3, n_head=2, d_model=24, seq_len=8, tied=False, bias=True,
                  norm="rmsnorm")]


@pytest.mark.parametrize("fp64", [False, True], ids=["fp32", "fp64"])
@pytest.mark.parametrize("cfg", CFGS, ids=["tied", "untied"])
def test_a_meta_built_model_is_bit_identical_to_the_serial_model(cfg: GPTConfig,
                                                                 fp64: bool) -> None:
    with float64() if fp64 else nullcontext():
        want = dict(GPT(cfg, seed=4).named_parameters())
        model = build_rank_model(cfg, 4, device=CPU)
    got = dict(model.named_parameters())
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert (model.head.weight is model.tok_emb.weight) == cfg.tied
    assert torch.equal(model.rope_cos, GPT(cfg).rope_cos)


@pytest.mark.parametrize("cfg", CFGS, ids=["tied", "untied"])
def test_every_pipeline_stage_holds_its_slice_of_the_serial_weights(cfg: GPTConfig) -> None:
    serial = dict(GPT(cfg, seed=6).named_parameters())
    held = set()
    for rank in range(2):
        layout = StageLayout(2, 1, rank, (1, cfg.n_layer - 1))
        stage = build_rank_model(cfg, 6, device=CPU, layout=layout)
        for name, p in stage.named_parameters():
            source = name if name in serial else "tok_emb.weight"  # the tied head's copy
            assert torch.equal(p, serial[source]), (rank, name)
            held.add(source)
    assert held == set(serial)
