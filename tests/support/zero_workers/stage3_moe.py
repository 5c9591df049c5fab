"""One rank of the ZeRO-3 mixture-of-experts test; returns what it saw (`tests.support.mpi_runs`).

    mpiexec -n 4 python -m tests.support.mpi_worker tests.support.zero_workers.stage3_moe:run OUT

A 4-layer MoE model (layers 0 and 2 MoE, 4 experts, top-2) is trained at dp 4 (data parallel
over 2 EP blocks of 2: ep 2, edp 2) with ``--zero 3`` in fp64 for 5 steps with the trainer's
own ``build_run``/``train_step``: the dense units sharded over the 4 DP ranks, the experts'
units over their 2 expert-data-parallel ranks (`trainer.parallel.zero.split`). After each
step the rank records the gathered bytes it holds (none between steps); at the end the bytes
it holds (`held_bytes` of every group's gradient shards) and those the ``--memory-budget``
meter measures (`measured_bytes`), the trainer's start-up memory line, its parameters,
gathered once, and how its units are split.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from tests.support.moe_workers.cases import FORWARDS, case_config
from tests.support.numerics import float64
from trainer.comm.bootstrap import init
from trainer.config.options import TrainConfig
from trainer.parallel.zero.memory import held_bytes
from trainer.parallel.zero.split import SplitUnits
from trainer.placement import placement_of
from trainer.train import memory_line
from trainer.training.plan_check import measured_bytes
from trainer.training.run import build_run, mesh_for
from trainer.training.step import train_step

STEPS = 5
MODEL = {"n_layer": 4}
"""Layers 0 and 2 are MoE layers (``moe_every`` 2): the experts have units in every other
block only."""
LAYOUT = {"dp": 4, "ep": 2, "microbatches": 1, "zero": 3, "precision": "fp32"}
"""4 forward passes of 2 sequences per step, as the serial reference's ``FORWARDS``."""
assert LAYOUT["dp"] * LAYOUT["microbatches"] == FORWARDS


def zero3_moe_config(layout: dict | None = LAYOUT, **train: object) -> TrainConfig:
    """The ZeRO-3 run (``layout`` None: the serial reference's single process)."""
    return case_config("dropless", layout, model=MODEL, steps=STEPS, **train)


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    with float64():
        cfg = zero3_moe_config(run_dir=str(out / "moe"))
        r = build_run(cfg, mesh_for(cfg, world))
        units = r.weights.units  # type: ignore[attr-defined]  # Zero3Optimizer's
        assert isinstance(units, SplitUnits)
        losses, gathered = [], []
        for step in range(1, STEPS + 1):
            units.peak_gathered_bytes = 0
            losses.append(train_step(r, step).loss)
            gathered.append((units.gathered_bytes, units.peak_gathered_bytes))
        units.peak_gathered_bytes = 0  # between steps: nothing gathered since the last
        held = held_bytes(units.shards, r.dp.buffers, r.weights.optimizer)
        measured = measured_bytes(r, saved_peak=0)  # what --memory-budget meters
        experts = [p for p in r.model.parameters() if "ep" not in placement_of(p).replicated]
        with units.whole():
            params = {n: p.detach().clone() for n, p in r.model.named_parameters()}
        return {
            "rank": world.rank, "losses": losses, "gathered": gathered, "params": params,
            "replicated": {n: placement_of(p).replicated
                           for n, p in r.model.named_parameters()},
            "parts": [{"group": part.comm.size, "blocks": part.blocks,
                       "params": sum(p.numel() for p in part.params),
                       "shard_elements": sum(s.numel() for s in part.shards)}
                      for part in units.parts],
            "pieces": {str(placement_of(t).replicated) for t in r.weights.values()},
            "n_params": sum(p.numel() for p in r.model.parameters()),
            "n_experts": sum(p.numel() for p in experts), "line": memory_line(r),
            "held": asdict(held), "measured": measured,
            "staged_peak": getattr(r.dp, "peak_staged_bytes", 0)}
