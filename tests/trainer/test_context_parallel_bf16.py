"""Context parallelism in bf16 (2 MPI ranks): cp 2 tracks cp 1 (dp 2) within a tolerance
derived from bf16's precision and the number of roundings, as `tests.trainer.test_mixed_precision`
derives its own (U = 2^-8 the bf16 unit roundoff, λ = 5, rounding errors independent and
zero-mean: K roundings compound to at most λ·√K·U relative with probability >= 1 -
2K·exp(-λ²/2); Higham & Mary 2019, Thm 2.4).

Each bf16 run is compared with the exact run through that bound, and the two bounds add
(triangle inequality). cp 1 (no TP): K = 17 bf16 roundings per layer on the longest path to the
loss (ln1, qkv weight and output, the rope tables and output, the attention probabilities and
output, proj weight and output, the residual sum; ln2, fc weight and output, GELU, proj weight
and output, the residual sum) and 4 more (embedding, ln_f, head weight, logits). cp 2 adds one
per layer forward (each block's output comes out of the kernel in bf16 before the fp32 merge,
which then rounds once more) and one per layer backward (each block's dQ, dK, dV likewise);
the K/V exchange, the merge and the dK/dV sums are fp32 and add none. The gradient sees 2K
roundings (plus those): r = λ·√(2K)·U relative, the weights drift by at most Σ 2·r·lr, and the
loss by λ·‖g‖·drift (‖g‖ the fp32 run's): the trajectory term. The loss falls by more than the
whole tolerance over the run, so a cp run that does not learn, or computes another model,
leaves it.
"""

from __future__ import annotations

import pytest

from tests.support.cp_workers.bf16 import GPT, RUNS, STEPS, WORKER
from tests.support.mpi_runs import world_run
from tests.support.numerics import bf16_tracking

K_CP1 = 17 * GPT["n_layer"] + 4
K_CP2 = K_CP1 + GPT["n_layer"]
"""Forward roundings of the longest path; cp 2 adds one per layer (each block's output)."""


def ranks() -> list[dict]:
    return world_run(WORKER, 2).ranks


def bound(k: int, extra_grad: int) -> list[float]:
    """How far a bf16 run with ``k`` forward roundings can be from the exact run, per step."""
    return bf16_tracking(ranks()[0]["fp32"], k=k, extra_grad=extra_grad)[0]


def tolerance() -> list[float]:
    return [a + b for a, b in zip(bound(K_CP1, 0), bound(K_CP2, 2 * GPT["n_layer"]),
                                  strict=True)]


@pytest.mark.parametrize("run", [name for name in RUNS if name.startswith("bf16-cp2")])
def test_a_bf16_run_at_cp_2_tracks_the_bf16_run_at_cp_1(run: str) -> None:
    tol = tolerance()
    for rank in ranks():
        assert rank[run]["dtype"] == rank["bf16-cp1"]["dtype"] == "torch.bfloat16"
        want, got = rank["bf16-cp1"]["losses"], rank[run]["losses"]
        assert len(got) == STEPS
        for step, (w, g, atol) in enumerate(zip(want, got, tol, strict=True), 1):
            assert abs(g - w) <= atol, (run, step, g, w, atol)


def test_a_run_that_did_not_learn_would_leave_the_tolerance() -> None:
    """Over the last 5 steps the cp 1 run's loss is below its first by more than that step's
    tolerance: a cp 2 run stuck near the initial loss (not learning, or learning another
    model) would fail the tracking test."""
    tol, losses = tolerance(), ranks()[0]["bf16-cp1"]["losses"]
    for step in range(STEPS - 5, STEPS):
        assert losses[0] - losses[step] > tol[step], (step + 1, losses, tol)
