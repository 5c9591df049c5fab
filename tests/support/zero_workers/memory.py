"""One rank of the ZeRO-3 memory test; returns what the trainer's accounting saw
(`tests.support.mpi_runs`).

    mpiexec -n 2 python -m tests.support.mpi_worker tests.support.zero_workers.memory:run OUT

A tiny model (4 blocks) is trained at dp = world size with ``--zero 3`` in fp32 for `STEPS`
steps at each prefetch depth of `PREFETCH`, with the trainer's own ``build_run``/``train_step``.
After every step the rank records the bytes it holds (`held_bytes`: parameter shards, gradient
shards, AdamW state), the gathered units and staged gradients left (none), and their peaks
during the step (`ParamUnits.peak_gathered_bytes`, `UnitGradients.peak_staged_bytes`); and,
for the test's formula, the parameter count of each unit by name (analytic, not the units').
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.zero_workers.cases import config
from trainer.comm.bootstrap import init
from trainer.parallel.zero import Zero3Optimizer
from trainer.parallel.zero.memory import held_bytes
from trainer.parallel.zero.units import unit_of
from trainer.training.run import build_run, mesh_for
from trainer.training.step import train_step

STEPS = 3
PREFETCH = (0, 1, 2)
N_LAYER = 4


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    result: dict[str, Any] = {"rank": world.rank}
    for prefetch in PREFETCH:
        cfg = config(world.size, 1, 1, {"n_layer": N_LAYER, "zero_prefetch": prefetch},
                     steps=STEPS, zero=3, precision="fp32", run_dir=str(out / f"p{prefetch}"))
        r = build_run(cfg, mesh_for(cfg, world))
        assert isinstance(r.weights, Zero3Optimizer)
        units, grads = r.weights.units, r.dp
        steps = []
        for step in range(1, STEPS + 1):
            units.peak_gathered_bytes = units.gathered_bytes
            train_step(r, step)
            held = held_bytes(units.shards, grads.buffer, r.weights.optimizer)
            steps.append({"params": held.params, "grads": held.grads,
                          "optimizer": held.optimizer,
                          "gathered": units.gathered_bytes, "staged": grads.staged_bytes,
                          "peak_gathered": units.peak_gathered_bytes,
                          "peak_staged": grads.peak_staged_bytes})
        numel: dict[str, int] = {}
        for name, p in r.model.named_parameters():
            numel[unit_of(name)] = numel.get(unit_of(name), 0) + p.numel()
        result[prefetch] = {"steps": steps, "unit_numel": numel,
                            "n_params": sum(numel.values())}
    return result
