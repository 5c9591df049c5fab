"""``--memory-budget``: a model whose training state is several times one rank's budget trains
at dp 4 with ``--zero 3`` and is refused at ``--zero 1`` with one clear memory error, before
the model is built (`trainer.plan.budget`); while it trains, the trainer's own accounting holds
every step to the budget (`trainer.training.budget`).

The model (24 blocks, prefetch 0; `tests/support/zero_workers/budget.py`) holds 16 bytes per
parameter in fp32 with AdamW. At dp 4 under ZeRO-3 a rank holds a quarter of that between steps
and, during a step, the root and one block with its gradients on top, so a budget a little over
that is about 3.5x smaller than the model's state: 4x is the ceiling at dp 4, reached only by a
model with no units to gather.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from tests.support.mpi_runs import run_ranks, world_run
from tests.support.zero_workers.budget import BUDGET_BYTES, N_LAYER, STEPS, budget_config
from trainer.errors import MemoryBudgetError
from trainer.plan.budget import check_budget

WORKER = "tests.support.zero_workers.budget:run"


@functools.cache
def ranks() -> list[dict]:
    return world_run(WORKER, 4).ranks


def model_state_bytes() -> int:
    return 16 * ranks()[0]["n_params"]  # fp32 parameters and gradients, AdamW's m and v


def test_the_budget_model_is_over_3_and_a_half_times_one_ranks_budget() -> None:
    assert model_state_bytes() >= 3.5 * BUDGET_BYTES


def test_zero1_over_the_budget_is_refused_naming_the_numbers_and_the_fix() -> None:
    with pytest.raises(MemoryBudgetError) as err:
        check_budget(budget_config(1), bf16=False, report=True)
    text = str(err.value)
    assert text.startswith("memory budget exceeded [--memory-budget 0.00128")
    assert "--zero 1, dp 4 x tp 1 x pp 1]" in text
    assert "over the budget of 1.32 MiB" in text
    assert "Shard more of it: --zero 3 (at this layout 1.29 MiB at the peak)" in text
    assert "raise --dp (now 4)" in text and text.endswith("or raise --memory-budget")


def test_zero3_under_the_budget_passes_the_check_before_anything_is_built() -> None:
    check_budget(budget_config(3), bf16=False, report=True)


def test_zero3_trains_with_every_step_measured_under_the_budget() -> None:
    for rank in ranks():
        assert len(rank["losses"]) == STEPS
        assert all(0 < peak <= BUDGET_BYTES for peak in rank["peaks"])
        assert rank["peaks"][-1] >= model_state_bytes() / 4  # its quarter, and units on top


def test_a_step_measured_over_the_budget_stops_every_rank_with_one_report() -> None:
    got = ranks()
    assert len({rank["stopped"].split(" (reported")[0] for rank in got}) == 1
    assert "memory budget exceeded" in got[0]["stopped"]
    assert "at the peak of step 4 (measured)" in got[0]["stopped"]
    assert [rank["stopped"].endswith("(reported: True)") for rank in got] == \
        [True, False, False, False]


def _flags(run_dir: Path, zero: int) -> list[str]:
    return ["-m", "trainer.train", "--model", "tiny", "--n-layer", str(N_LAYER), "--n-head",
            "2", "--d-model", "32", "--seq-len", "32", "--global-batch", "8", "--dp", "4",
            "--precision", "fp32", "--zero", str(zero), "--zero-prefetch", "0",
            "--memory-budget", str(BUDGET_BYTES / 2**30), "--steps", str(STEPS),
            "--data-cap-mb", "0.25", "--eval-every", "0", "--run-dir", str(run_dir)]


def test_through_trainer_train_zero3_trains_and_zero1_is_refused_once(tmp_path: Path) -> None:
    z3 = run_ranks(4, _flags(tmp_path / "z3", 3))
    assert z3.returncode == 0, z3.stdout[-3000:]
    records = [json.loads(line) for line in
               (tmp_path / "z3" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    z1 = run_ranks(4, _flags(tmp_path / "z1", 1))
    assert z1.returncode != 0
    assert z1.stdout.count("memory budget exceeded") == 1, z1.stdout[-3000:]
    assert not (tmp_path / "z1" / "metrics.jsonl").exists()
