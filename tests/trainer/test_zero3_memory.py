"""ZeRO-3's memory per rank against the analytic table, measured with the trainer's own
accounting on CPU (`trainer.parallel.zero.memory`, `trainer.parallel.zero.units`), real MPI
ranks at dp 2 and dp 4, fp32 (`tests/support/zero_workers/memory.py`).

* Between steps a rank holds parameters/dp + gradients/dp + optimizer/dp: Megatron's table
  (`expected_bytes`, 16/dp bytes per parameter, as ``bench.memory`` prints it for ZeRO-1),
  within 5% (the units are padded to dp by < dp elements each).
* During a step it holds that plus the root (embedding, final norm, head: gathered for the
  whole forward and backward) and at most prefetch + 1 blocks with their gradients: the block
  computing and the ``prefetch`` gathered ahead of it, and in backward the block filling its
  gradients and the ``prefetch`` reduce-scatters in flight behind it (the reductions in flight
  are capped at the prefetch depth). The parameters' part is exact (gathers are posted and
  freed by hooks, never by timing); how many reductions are still in flight when the next
  block's gradients start depends on the network, so the gradients' part is bounded above,
  and exact at prefetch 0 (every reduction waited for at once).
"""

from __future__ import annotations

import pytest

from tests.support.mpi_runs import world_run
from tests.support.zero_workers.memory import N_LAYER, PREFETCH, STEPS
from trainer.parallel.zero.memory import expected_bytes

WORKER = "tests.support.zero_workers.memory:run"
FP32 = 4
WITHIN = 0.05


def ranks(dp: int) -> list[dict]:
    return world_run(WORKER, dp).ranks


def formula(got: dict, dp: int, prefetch: int) -> tuple[int, int, int]:
    """(between steps, the parameters' peak on top, the gradients' peak on top), in bytes."""
    table = expected_bytes(got["n_params"], bf16=False, zero=3, dp=dp)
    numel = got["unit_numel"]
    blocks = [n for unit, n in numel.items() if unit]
    assert len(blocks) == N_LAYER and prefetch + 1 <= N_LAYER
    block = FP32 * max(blocks)
    return table.total, FP32 * numel[""] + (prefetch + 1) * block, (prefetch + 1) * block


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("prefetch", PREFETCH)
def test_between_zero3_steps_a_rank_holds_params_grads_and_optimizer_over_dp(
        dp: int, prefetch: int) -> None:
    for rank in ranks(dp):
        got = rank[prefetch]
        between, _, _ = formula(got, dp, prefetch)
        assert len(got["steps"]) == STEPS
        for step in got["steps"]:
            held = step["params"] + step["grads"] + step["optimizer"]
            assert held == pytest.approx(between, rel=WITHIN), (rank["rank"], step)
            assert step["params"] == step["grads"] == step["optimizer"] // 2
            assert step["gathered"] == step["staged"] == 0  # nothing gathered is left


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("prefetch", PREFETCH)
def test_a_zero3_step_peaks_at_the_root_and_prefetch_plus_1_units_with_their_gradients(
        dp: int, prefetch: int) -> None:
    for rank in ranks(dp):
        got = rank[prefetch]
        between, params_on_top, grads_on_top = formula(got, dp, prefetch)
        for step in got["steps"]:
            assert step["peak_gathered"] == pytest.approx(params_on_top, rel=WITHIN)
            block_grads = grads_on_top // (prefetch + 1)
            assert block_grads * (1 - WITHIN) <= step["peak_staged"]
            assert step["peak_staged"] <= grads_on_top * (1 + WITHIN)
            peak = between + step["peak_gathered"] + step["peak_staged"]
            assert peak <= (between + params_on_top + grads_on_top) * (1 + WITHIN)
            if prefetch == 0:
                assert peak == pytest.approx(between + params_on_top + grads_on_top,
                                             rel=WITHIN)
