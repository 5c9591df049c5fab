"""A padded vocabulary (``--vocab-multiple``, `trainer.gpu.vocab`) is the same model as the
unpadded one, in one process: the real rows and every other weight start where an unpadded
model's do whatever the padding (so whatever the tp the padding follows), the padded rows start
at zero, a tensor-parallel shard built on the meta device is its slice of that, and the
pipeline's last stage computes the serial model's loss and gives the padded rows no gradient.
Real training of every layout over MPI: tests/trainer/test_padded_vocab_training.py.

Both sides draw the same numbers from the same generator, so initial weights are compared bit
for bit; losses run in fp64 and differ only by the order of their sums (tests/support/numerics.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from tests.support.numerics import float64, reduction_rtol
from trainer.construction import build_rank_model
from trainer.gpu.vocab import multiple_for_tp
from trainer.model.config import PRESETS, GPTConfig, MoEConfig
from trainer.model.family import build_model
from trainer.parallel.pipeline.partition import StageLayout
from trainer.parallel.pipeline.stages import GPTStage
from trainer.parallel.tensor import shard_spec, shard_tensor

CPU = torch.device("cpu")
VOCAB = 1003  # an imported vocabulary that is no multiple of anything useful
CFGS = {
    "gpt-tied": GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, d_model=16, seq_len=8),
    "gpt-untied": GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, d_model=16, seq_len=8,
                            tied=False, bias=True, norm="rmsnorm"),
    "llama": replace(PRESETS["llama-tiny"], vocab_size=VOCAB, d_model=32, seq_len=8),
}
#: Experts are built whole, then cut (`trainer.training.run`): the serial init is theirs.
MOE = replace(CFGS["gpt-tied"], moe=MoEConfig(experts=2, topk=1))
VOCAB_WEIGHTS = ("tok_emb.weight", "head.weight")


def padded(cfg: GPTConfig, multiple: int) -> GPTConfig:
    return replace(cfg, vocab_multiple=multiple)


def unpadded_weights(cfg: GPTConfig, seed: int, rows: int) -> dict[str, torch.Tensor]:
    """The unpadded model's initial weights, the vocabulary's given ``rows`` zero rows."""
    out = {}
    for name, p in build_model(padded(cfg, 1), seed=seed).named_parameters():
        if name in VOCAB_WEIGHTS:
            p = torch.cat([p, p.new_zeros(rows - VOCAB, *p.shape[1:])])
        out[name] = p.detach()
    return out


@pytest.mark.parametrize("multiple", [8, 64, 128 * 4])
@pytest.mark.parametrize("arch", [*CFGS, "gpt-moe"])
def test_the_real_weights_start_the_same_whatever_the_padding_and_the_padded_rows_at_zero(
        arch: str, multiple: int) -> None:
    cfg = padded(CFGS.get(arch, MOE), multiple)
    want = unpadded_weights(cfg, 7, cfg.vocab_rows)
    got = dict(build_model(cfg, seed=7).named_parameters())
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("arch", CFGS)
def test_every_tensor_parallel_shard_built_on_the_meta_device_is_a_slice_of_the_unpadded_model(
        arch: str, tp: int) -> None:
    """The padding follows tp (`multiple_for_tp`): 1008 rows at tp 2, 1024 at tp 4."""
    cfg = padded(CFGS[arch], multiple_for_tp(8, tp))
    want = unpadded_weights(cfg, 3, cfg.vocab_rows)
    for rank in range(tp):
        model = build_rank_model(cfg, 3, device=CPU, tp=Seat(rank, tp))
        for name, p in model.named_parameters():
            spec = shard_spec(p)
            expected = want[name] if spec is None else shard_tensor(want[name], rank, tp, spec)
            assert torch.equal(p, expected), (rank, name)


@dataclass(frozen=True)
class Seat:
    """A rank's place in a tensor-parallel group, all that construction reads of the group
    (it never communicates)."""

    rank: int
    size: int


@pytest.mark.parametrize("arch", CFGS)
def test_the_last_pipeline_stage_computes_the_serial_loss_and_no_gradient_for_padded_rows(
        arch: str) -> None:
    cfg = padded(CFGS[arch], 128)  # 1003 -> 1024 rows
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, VOCAB, (2, cfg.seq_len), generator=gen) for _ in range(2))
    with float64():
        want = build_model(padded(cfg, 1), seed=5).loss(x, y)
        stages = [GPTStage(build_rank_model(cfg, 5, device=CPU,
                                            layout=StageLayout(2, 1, rank, (1, cfg.n_layer - 1))),
                           StageLayout(2, 1, rank, (1, cfg.n_layer - 1))) for rank in range(2)]
        for stage in stages:
            stage.begin_step([(x, y)])
        h = stages[0].forward(0, 0, None)
        loss = stages[1].forward(0, 0, h.detach())
        stages[1].backward(0, 0, None)
    # The longest sum: the softmax's over the 1024 rows, or the mean over tokens.
    torch.testing.assert_close(loss, want, rtol=reduction_rtol(cfg.vocab_rows), atol=0)
    head = stages[1].model.head.weight.grad
    assert (head[VOCAB:] == 0).all() and (head[:VOCAB] != 0).any()
