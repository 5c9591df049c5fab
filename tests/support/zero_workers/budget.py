"""One rank of the memory-budget test (`tests.support.mpi_runs`, 4 ranks).

    mpiexec -n 4 python -m tests.support.mpi_worker tests.support.zero_workers.budget:run OUT

The budget test's model (`budget_config`) is built at dp 4 with ``--zero 3`` under its budget
and trained for `STEPS` steps with the trainer's own ``build_run``/``train_step``, its
`BudgetMeter` measuring after every step as ``trainer.train`` does; then a meter with a cap one
byte under the measured peak must stop the run on every rank with the same error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.zero_workers.cases import config
from trainer.comm.bootstrap import init
from trainer.config.options import TrainConfig
from trainer.errors import MemoryBudgetError
from trainer.training.budget import BudgetMeter
from trainer.training.run import build_run, mesh_for
from trainer.training.step import train_step

STEPS = 3
N_LAYER = 24
BUDGET_BYTES = 1_380_000
"""The cap the test imposes: a little over what one rank holds at dp 4, zero 3, prefetch 0."""


def budget_config(zero: int, **train: object) -> TrainConfig:
    return config(4, 1, 1, {"n_layer": N_LAYER, "zero_prefetch": 0}, steps=STEPS, zero=zero,
                  precision="fp32", memory_budget=BUDGET_BYTES / 2**30, **train)


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    cfg = budget_config(3, run_dir=str(out / "z3"))
    r = build_run(cfg, mesh_for(cfg, world))
    meter = BudgetMeter.of(r)
    assert meter is not None
    losses, peaks = [], []
    for step in range(1, STEPS + 1):
        losses.append(train_step(r, step).loss)
        meter.after_step(step)
        peaks.append(meter.peak)
    strict = BudgetMeter(r, meter.peak - 1)
    train_step(r, STEPS + 1)
    try:
        strict.after_step(STEPS + 1)
        stopped = ""
    except MemoryBudgetError as exc:
        stopped = f"{exc} (reported: {exc.report})"
    return {"rank": world.rank, "losses": losses, "peaks": peaks, "stopped": stopped,
            "n_params": sum(p.numel() for p in r.model.parameters())}
