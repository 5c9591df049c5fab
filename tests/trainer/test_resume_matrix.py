"""Resume at any layout: a checkpoint saved at layout A is resumed at layout B, for pairs that
change every axis at least once (dp 2→4 and 4→1, tp 2→1 and 1→4, cp 2→1 and 1→4, pp 2→4 with
interleaved stages, the layers of the stages, ep 2→4 and 2→1, ZeRO-1 on and off, ZeRO-2 from
2x2x2 to dp 4, ZeRO-3 to ZeRO-1 at dp 2 and back at dp 4, ZeRO-3 from dp2 x tp2 to dp 4 and from
shard size 2 to 4, ZeRO-3 at cp 2 x dp 2 to dp 4 and dp 4 to ZeRO-2 at cp 2 x dp 2, bf16 main
weights and fp32 both ways, and 2x2x2 → 1x4x1; `tests.support.resume_workers.cases`), with real
MPI ranks.

Right after the load every rank holds its slice of the saved state, bit for bit: its main
weights and their AdamW moments, each cut from the whole saved tensor the way the trainer's TP
code cuts it (`tests.support.saved.slice_of`), and the model's parameters (under bf16 the rounding
of
the main weights). Then the next steps match the same checkpoint resumed at its saved layout.

Tolerances (tests/support/numerics.py, not tuned): in fp64 two layouts differ only in the order of
their sums (the gradient of a parameter summed over other ranks and microbatches, matmuls cut
over TP, the norm summed over the world, tokens routed to experts on other ranks), so losses
agree to the reduction bound plus the first-order effect of rounded updates (`loss_atol`), and
parameters to the reduction bound carried through Adam (`adam_atol`), over the steps after the
load. A wrong slice moves its elements by O(lr) = 3e-3 at once, far above both. Between bf16
and fp32 the continuation differs by bf16's rounding: the tracking tolerance derived in
tests/trainer/test_mixed_precision.py (losses) and its weight drift bound (parameters).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.mpi_runs import world_run
from tests.support.numerics import bf16_tracking, reduction_rtol
from tests.support.resume_workers.cases import (
    GLOBAL_BATCH,
    LR,
    MODELS,
    MORE,
    PAIRS,
    SAVED_AT,
    SEQ,
    TRAIN,
    WORKER,
    WORLD,
    Pair,
)
from tests.support.saved import saved_state, slice_of
from tests.support.serial_reference import bounds, train_serially
from trainer.config.options import make_config

IDS = [p.name for p in PAIRS]


@functools.cache
def ranks() -> list[dict[str, Any]]:
    return world_run(WORKER, WORLD).ranks


def saved_key(pair: Pair) -> str:
    return f"{pair.model}-{pair.saved.name}-{'fp64' if pair.fp64 else 'fp32'}"


def runs(pair: Pair, role: str) -> list[dict[str, Any]]:
    """What every rank of the run saw (the ranks outside its layout return None)."""
    key = (pair.name if role == "resumed" else saved_key(pair), role)
    return [r["pairs"][key] for r in ranks() if r["pairs"][key] is not None]


@functools.cache
def state(path: str) -> dict[str, dict[str, torch.Tensor]]:
    return saved_state(Path(path))


@pytest.mark.parametrize("pair", PAIRS, ids=IDS)
def test_right_after_loading_every_rank_holds_its_slice_of_the_saved_state_bit_for_bit(
        pair: Pair) -> None:
    saved = state(str(Path(ranks()[0]["saved"][saved_key(pair)]) / "checkpoints" /
                      f"step-{SAVED_AT}"))
    for role in ("reference", "resumed"):
        got = runs(pair, role)
        assert len(got) == (pair.resumed if role == "resumed" else pair.saved).ranks
        for rank in got:
            assert rank["start"] == SAVED_AT
            for tensor, placement, moments in rank["loaded"]:
                want = slice_of(saved["param"][placement.name], placement)
                assert tensor.dtype == want.dtype and torch.equal(tensor.view(-1), want), \
                    (role, placement)
                for kind in ("exp_avg", "exp_avg_sq"):
                    want = slice_of(saved[kind][placement.name], placement)
                    assert torch.equal(moments[kind].view(-1), want), (role, kind, placement)
                assert int(moments["step"]) == SAVED_AT
            for param, placement in rank["params"]:  # bf16: the rounded main weights
                want = slice_of(saved["param"][placement.name], placement)
                assert torch.equal(param.view(-1), want.to(param.dtype)), (role, placement)


@functools.cache
def serial(model: str) -> dict:
    """The single-process fp64 run of ``model`` on the pairs' data, for its parameter count and
    measured gradient scale (every step, the saved ones and those after the load)."""
    return train_serially(make_config(TRAIN, MODELS[model]), SAVED_AT + MORE)


def tolerances(pair: Pair) -> tuple[float, list[float], float]:
    """(loss rtol, loss atol of every step, parameter atol) between the two continuations."""
    tokens = GLOBAL_BATCH * SEQ + MODELS[pair.model]["d_model"]
    if pair.fp64:
        tol = bounds(serial(pair.model), steps=MORE, lr=LR, n_terms=tokens)
        return reduction_rtol(tokens), [tol.loss] * MORE, tol.params
    # bf16 against fp32 (the side in fp32 gives the norms): tests/trainer/test_mixed_precision.py
    k = 19 * MODELS[pair.model]["n_layer"] + 4
    fp32 = runs(pair, "reference" if pair.saved.options.get("precision") != "bf16"
                else "resumed")[0]
    atol, drift = bf16_tracking(fp32, k=k)
    return 0.0, atol, drift


@pytest.mark.parametrize("pair", PAIRS, ids=IDS)
def test_the_next_steps_match_a_resume_at_the_saved_layout(pair: Pair) -> None:
    reference, resumed = runs(pair, "reference")[0], runs(pair, "resumed")[0]
    rtol, atol, param_atol = tolerances(pair)
    for step, (got, want, tol) in enumerate(zip(resumed["losses"], reference["losses"], atol,
                                                 strict=True), SAVED_AT + 1):
        assert abs(got - want) <= rtol * abs(want) + tol, (step, got, want)
    assert len({tuple(r["losses"]) for r in runs(pair, "resumed")}) == 1  # every rank alike
    ends = [state(run["final"])["param"] for run in (reference, resumed)]
    assert ends[0].keys() == ends[1].keys()
    for name, want in ends[0].items():
        torch.testing.assert_close(ends[1][name].double(), want.double(),
                                   rtol=rtol, atol=param_atol, msg=name)
