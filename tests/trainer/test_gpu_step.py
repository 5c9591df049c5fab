"""The GPU-friendly step, shown on CPUs: one host read per step whatever the microbatches, the
loss left on the device until the logging interval, and a padded vocabulary that is never
predicted (serial and split over TP = 2).

The host reads are counted with `tests.support.host_syncs` (a dispatch mode that sees ``.item()``
and
friends on any device). The two-rank run is one cached MPI job (`tests.support.gpu_workers.step`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tests.support.gpu_workers.step import PADDED, batch
from tests.support.mpi_runs import world_run
from tests.support.numerics import float64, reduction_rtol
from trainer.config.options import make_config
from trainer.inference.sampling import sample
from trainer.model.flops import matmul_params
from trainer.model.gpt import GPT

WORKER = "tests.support.gpu_workers.step:run"


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return world_run(WORKER, 2).ranks


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_a_step_of_four_microbatches_reads_the_device_once(ranks: list[dict], layout: str):
    for rank in ranks:
        got = rank[layout]
        # Step 1 creates AdamW's state, whose host-side step counters are ignored from step 2.
        assert got["counts"][1:] == [1, 1], got["ops"]
        assert got["ops"][1:] == [["_local_scalar_dense"]] * 2  # the guard's one bool


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_a_step_leaves_its_loss_and_norm_on_the_device_until_the_interval_reads_them(
        ranks: list[dict], layout: str):
    for rank in ranks:
        got = rank[layout]
        assert got["pending_is_tensor"] == [True] * 3
        assert got["read_count"] == 0  # one copy of the whole interval, no value-by-value read
        assert all(math.isfinite(v) and v > 0 for v in got["losses"] + got["norms"])
    assert ranks[0][layout]["losses"] == ranks[1][layout]["losses"]  # every rank logs alike


def _serial() -> tuple[GPT, torch.Tensor, torch.Tensor]:
    with float64():
        model = GPT(PADDED, seed=3)
        x, y = batch()
        logits = model(x)
        loss = model.loss(x, y)
        loss.backward()
    return model, logits, loss


def test_padded_vocabulary_rows_are_never_predicted_and_get_no_gradient():
    model, logits, _ = _serial()
    grad = model.tok_emb.weight.grad
    assert model.tok_emb.weight.shape[0] == PADDED.vocab_rows == 256
    assert (torch.softmax(logits, -1)[..., PADDED.vocab_size:] == 0).all()
    assert (grad[PADDED.vocab_size:] == 0).all() and grad[:PADDED.vocab_size].abs().sum() > 0


def test_padding_leaves_the_loss_over_the_real_vocabulary_unchanged():
    padded, _, loss = _serial()
    with float64():
        plain = GPT(replace(PADDED, vocab_multiple=1), seed=3)
        plain.load_state_dict({k: v[:PADDED.vocab_size] if k in ("tok_emb.weight",
                                                                  "head.weight") else v
                               for k, v in padded.state_dict().items()})
        x, y = batch()
        expected = plain.loss(x, y)
    torch.testing.assert_close(loss, expected, rtol=reduction_rtol(PADDED.vocab_rows), atol=0)


def test_sampling_never_draws_a_padded_row():
    model, _, _ = _serial()
    # At temperature 50 the real rows are close to uniform: unmasked, 1 draw in 5 would be
    # a padded row (56 of 256), so 64 draws would all miss them with probability 1e-6.
    with float64():
        drawn = sample(model.eval(), b"ab", tokens=64, temperature=50.0, seed=1)
    assert max(drawn) < PADDED.vocab_size


def test_tensor_parallel_padding_matches_the_serial_loss_and_masks_the_last_shard(
        ranks: list[dict]):
    _, _, loss = _serial()
    got = [r["padding"] for r in ranks]
    assert [g["start"] for g in got] == [0, 128] and [g["rows"] for g in got] == [128, 128]
    for g in got:
        assert g["loss"] == pytest.approx(loss.item(), rel=reduction_rtol(PADDED.vocab_rows))
    last = got[1]["grad"]  # rows 128..255: 128..199 real, 200..255 padding
    assert (last[PADDED.vocab_size - 128:] == 0).all() and last[:72].abs().sum() > 0


def test_the_gpt_124m_preset_is_gpt2_small_with_its_vocabulary_padded_to_128_rows():
    gpt = make_config({"model": "gpt-124m"}, {}).gpt
    assert (gpt.n_layer, gpt.d_model, gpt.n_head, gpt.seq_len) == (12, 768, 12, 1024)
    assert (gpt.vocab_size, gpt.vocab_rows) == (50257, 50304)
    assert 123e6 < matmul_params(gpt) < 125e6  # tied: every parameter counted once
    medium = make_config({"model": "gpt-350m"}, {}).gpt
    assert (medium.n_layer, medium.d_model, medium.n_head) == (24, 1024, 16)
    assert 350e6 < matmul_params(medium) < 357e6


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_vocabulary_is_padded_to_a_multiple_of_128_times_tp(tp: int):
    gpt = make_config({"model": "gpt-124m", "tp": tp}, {}).gpt
    assert gpt.vocab_rows % (128 * tp) == 0 and 0 <= gpt.vocab_rows - 50257 < 128 * tp
    assert make_config({"model": "tiny", "tp": 2}, {}).gpt.vocab_rows == 256  # unpadded


def test_a_checkpoint_padded_for_another_tp_matches_the_same_model(tmp_path) -> None:
    """The padding multiple follows tp (its rows are masked, never trained): resuming at
    another tp is the same model, and the rows both paddings have are read back."""
    from trainer.checkpoint.load import check_compatible

    check_compatible({"model": replace(PADDED, vocab_multiple=128).to_dict()},
                     model=PADDED.to_dict(), path=tmp_path)
