"""One rank of the bf16 context-parallel test (`tests.trainer.test_context_parallel_bf16`).

    mpiexec -n 2 python -m tests.support.mpi_worker tests.support.cp_workers.bf16:run OUT

Trains the same small GPT for `STEPS` steps with the trainer's own ``build_run``/``train_step``
on 2 ranks: in fp32 at dp 2 (the magnitudes the test's tolerance is derived from), in bf16 at
dp 2 (cp 1), and in bf16 at cp 2 with either exchange, from the same fp32 initial weights and
the same global batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.comm.bootstrap import init
from trainer.config.options import make_config
from trainer.training.run import build_run, mesh_for
from trainer.training.step import train_step

WORKER = "tests.support.cp_workers.bf16:run"
STEPS = 20
GPT = {"model": "tiny", "n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 32}
TRAIN = {"steps": STEPS, "global_batch": 8, "microbatches": 2, "lr": 1e-2, "min_lr": 1e-3,
         "warmup_steps": 2, "seed": 7, "data_cap_mb": 0.25, "grad_clip": 1.0, "eval_every": 0}
RUNS = {"fp32": {"precision": "fp32", "dp": 2},
        "bf16-cp1": {"precision": "bf16", "dp": 2},
        "bf16-cp2-ring": {"precision": "bf16", "dp": 1, "cp": 2, "cp_comm": "ring"},
        "bf16-cp2-allgather": {"precision": "bf16", "dp": 1, "cp": 2,
                               "cp_comm": "allgather"}}


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    result: dict[str, Any] = {}
    for name, layout in RUNS.items():
        cfg = make_config({**TRAIN, **layout, "run_dir": str(out / name)}, GPT)
        state = build_run(cfg, mesh_for(cfg, world))
        records = [train_step(state, step) for step in range(1, STEPS + 1)]
        result[name] = {"losses": [r.loss for r in records],
                        "norms": [r.grad_norm for r in records], "lrs": [r.lr for r in records],
                        "dtype": str(next(state.model.parameters()).dtype)}
    return result
