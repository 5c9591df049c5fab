"""Training with a padded vocabulary equals the single process without the padding, on every
layout: same initial weights bit for bit, same losses, same parameters, padded rows never
trained.

The worker (`tests.support.padded_vocab_workers.worker`, one ``mpiexec`` run of 4 ranks) builds each
case of `tests.support.padded_vocab_workers.cases` (vocabulary 1003 padded to 1008 or 1024 rows:
dp x tp,
tp 4, dp x pp, tp x pp interleaved, a Llama at tp x pp) with the trainer's own ``build_run``,
records its initial weights and the loss of one batch through the run's validation forward,
then trains 5 steps with ``train_step``. The reference is the plain model in this process, in
the same microbatches, with the vocabulary not padded at all.

The initial weights draw the same numbers from the same generator, so they are compared bit for
bit (the padded rows start at zero). Losses and parameters run in fp64 on both sides and differ
only by the order of sums, so the tolerances are the fp64 bounds of tests/support/numerics.py: the
loss
of a batch to the reduction bound, training losses to that plus the first-order effect of
rounded updates, parameters to the reduction bound carried through Adam. A pipeline that does
not mask the padded rows is off by ln(1008/1003) = 5e-3 at the first step; a padding that
shifts the initialisation moves whole weights by O(0.02).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.support.mpi_runs import world_run
from tests.support.numerics import f64, float64, reduction_rtol
from tests.support.padded_vocab_workers.cases import (
    CASES,
    GLOBAL_BATCH,
    MULTIPLE,
    STEPS,
    VOCAB,
    WORKER,
    WORLD,
    Case,
    config,
    serial_reference,
)
from tests.support.padded_vocab_workers.worker import eval_batch
from tests.support.serial_reference import Bounds, bounds
from trainer.model.family import build_model

SEQ, WIDEST = 16, 4 * 32  # the cases' context and MLP width
#: The longest sum anywhere, bounded by their total: the softmax's over the 1024 rows, a
#: gradient's over the global batch's tokens, a matmul's over the MLP's width.
N_TERMS = 1024 + GLOBAL_BATCH * SEQ + WIDEST
RTOL = reduction_rtol(N_TERMS)
LR = 3e-3  # the cases' lr: the size of one Adam step
IDS = [c.name for c in CASES]
VOCAB_WEIGHTS = ("tok_emb.weight", "head.weight")  # one row per vocabulary entry


@functools.cache
def ranks() -> list[dict[str, Any]]:
    return world_run(WORKER, WORLD).ranks


def merged(c: Case, key: str) -> dict[str, torch.Tensor]:
    """DP replica 0's ``key`` parameters (TP re-assembled) of every stage, by name."""
    out: dict[str, torch.Tensor] = {}
    for r in ranks():
        tp, dp, _ = r[c.name]["coords"]
        if tp == 0 and dp == 0:
            out.update(r[c.name][key])
    return out


def unpadded(c: Case) -> dict:
    return serial_reference(c.family, 1)


def tolerances(ref: dict) -> Bounds:
    return bounds(ref, steps=STEPS, lr=LR, n_terms=N_TERMS)


def assert_matches_the_unpadded(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                                tied: bool, atol: float) -> None:
    """``got`` (padded) holds ``want``'s weights, its padded rows exactly zero; the last
    stage's copy of a tied embedding is the embedding."""
    assert got.keys() == want.keys() | ({"head.weight"} if tied else set())
    for name, value in got.items():
        source = "tok_emb.weight" if tied and name == "head.weight" else name
        real = value[:VOCAB] if name in VOCAB_WEIGHTS else value
        torch.testing.assert_close(real, want[source], rtol=0, atol=atol, msg=name)
        if name in VOCAB_WEIGHTS:
            assert value.shape[0] > VOCAB and torch.count_nonzero(value[VOCAB:]) == 0, name


def test_the_padding_grows_with_tp_as_the_trainer_pads() -> None:
    rows = {c.name: ranks()[0][c.name]["rows"] for c in CASES}
    assert rows == {"dp2-tp2": 1008, "tp4": 1024, "dp2-pp2-1f1b": 1008,
                    "tp2-pp2-interleaved": 1008, "llama-tp2-pp2-1f1b": 1008}


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_single_process_trains_the_same_model_with_and_without_the_padding(
        family: str) -> None:
    padded, plain = serial_reference(family, MULTIPLE), serial_reference(family, 1)
    torch.testing.assert_close(f64(padded["losses"]), f64(plain["losses"]), rtol=RTOL,
                               atol=tolerances(plain).loss)
    assert_matches_the_unpadded(padded["params"], plain["params"], tied=False,
                                atol=tolerances(plain).params)


@pytest.mark.parametrize("c", CASES, ids=IDS)
def test_every_layout_starts_from_the_unpadded_models_weights_bit_for_bit(c: Case) -> None:
    cfg = config(c.family, multiple=1)
    with float64():
        want = {n: p.detach() for n, p in build_model(cfg.gpt, seed=cfg.seed).named_parameters()}
    tied = cfg.gpt.tied and c.pp > 1
    assert_matches_the_unpadded(merged(c, "initial"), want, tied=tied, atol=0)


@pytest.mark.parametrize("c", CASES, ids=IDS)
def test_every_layout_computes_the_unpadded_models_loss_of_a_batch(c: Case) -> None:
    cfg = config(c.family, multiple=1)
    got = [r[c.name] for r in ranks() if r[c.name]["eval_loss"] is not None]
    assert len(got) == WORLD // c.pp  # the last stage of each pipeline, or every rank
    with float64():
        x, y = eval_batch(got[0]["micro_batch"], SEQ)
        want = build_model(cfg.gpt, seed=cfg.seed).loss(x, y).item()
    for r in got:
        assert r["eval_loss"] == pytest.approx(want, rel=RTOL, abs=0), r["coords"]


@pytest.mark.parametrize("c", CASES, ids=IDS)
def test_every_layout_trains_the_losses_and_norms_of_the_unpadded_single_process(c: Case
                                                                                ) -> None:
    ref = unpadded(c)
    tol = tolerances(ref)
    for r in ranks():
        got = r[c.name]
        torch.testing.assert_close(f64(got["losses"]), f64(ref["losses"]), rtol=RTOL,
                                   atol=tol.loss, msg=f"{got['coords']}")
        torch.testing.assert_close(got["norms"][0], ref["norms"][0], rtol=RTOL, atol=tol.norm)


@pytest.mark.parametrize("c", CASES, ids=IDS)
def test_every_layout_ends_with_the_single_process_weights_and_untrained_padded_rows(
        c: Case) -> None:
    tied = config(c.family).gpt.tied and c.pp > 1
    assert_matches_the_unpadded(merged(c, "params"), unpadded(c)["params"], tied=tied,
                                atol=tolerances(unpadded(c)).params)

