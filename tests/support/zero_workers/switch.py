"""One rank of the generation-switch test (`tests.support.mpi_runs`, 4 ranks).

    mpiexec -n 4 python -m tests.support.mpi_worker tests.support.zero_workers.switch:run OUT

In fp64 a dp 4 ``--zero 3`` run (the trainer's own ``build_run``/``train_step``) trains
`BEFORE` steps, switches to tensor-parallel generation at tp 2 and at tp 4
(`trainer.inference.switch.generate_tp`, greedy) and back, and trains `AFTER` more steps. The
rank records the tokens, its shards and AdamW state before and after the switches, the whole
weights at the switch (gathered once, for the single-process reference), and the losses and
final shards, next to a second run of the same config that never switches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.numerics import float64
from tests.support.zero_workers.cases import _GPT, _TRAIN
from trainer.comm.bootstrap import init
from trainer.config.options import TrainConfig, make_config
from trainer.inference.switch import generate_tp
from trainer.parallel.zero import Zero3Optimizer
from trainer.training.run import Run, build_run, mesh_for
from trainer.training.step import train_step

BEFORE, AFTER = 2, 3
PROMPTS = [[104, 101, 108, 108, 111], [100, 101, 102, 32]]
"""One per TP group at tp 2 (ranks 0-1, ranks 2-3); the first at tp 4."""
TOKENS = 12


def switch_config(run_dir: str) -> TrainConfig:
    """ZeRO-1's tiny case (`tests.support.zero_workers.cases`) with 3 blocks of 4 heads, which
    tp 4 splits."""
    return make_config({**_TRAIN, "dp": 4, "steps": BEFORE + AFTER, "zero": 3,
                        "precision": "fp32", "run_dir": run_dir},
                       {**_GPT, "n_layer": 3, "n_head": 4})


def state(r: Run) -> dict[str, Any]:
    """Bit copies of what training holds: parameter shards, gradient shards, AdamW state."""
    assert isinstance(r.weights, Zero3Optimizer)
    opt = r.weights.optimizer
    return {"shards": [s.clone() for s in r.weights.units.shards],
            "grads": r.dp.buffer.clone(),
            "adam": [{k: v.clone() if isinstance(v, torch.Tensor) else v
                      for k, v in opt.state[p].items()}
                     for g in opt.param_groups for p in g["params"]]}


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    got: dict[str, Any] = {"rank": world.rank}
    with float64():
        cfg = switch_config(str(out / "switched"))
        r = build_run(cfg, mesh_for(cfg, world))
        assert isinstance(r.weights, Zero3Optimizer)
        units = r.weights.units
        losses = [train_step(r, step).loss for step in range(1, BEFORE + 1)]
        got["before"] = state(r)
        with units.whole():
            got["whole"] = {k: v.detach().clone() for k, v in r.model.state_dict().items()}
        got["tp2"] = generate_tp(r.model, units, PROMPTS[world.rank // 2], tp=2,
                                 tokens=TOKENS, temperature=0)
        got["tp4"] = generate_tp(r.model, units, PROMPTS[0], tp=4, tokens=TOKENS,
                                 temperature=0)
        got["after"] = state(r)
        got["gathered_after"] = (sorted(units.held), units.gathered_bytes)
        losses += [train_step(r, step).loss for step in range(BEFORE + 1, BEFORE + AFTER + 1)]
        got["losses"], got["final"] = losses, state(r)["shards"]

        plain_cfg = switch_config(str(out / "plain"))
        plain = build_run(plain_cfg, mesh_for(plain_cfg, world))
        got["plain_losses"] = [train_step(plain, step).loss
                               for step in range(1, BEFORE + AFTER + 1)]
        got["plain_final"] = state(plain)["shards"]
    return got
