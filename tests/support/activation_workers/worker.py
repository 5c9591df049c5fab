"""One rank of the sequence-parallel / recompute / construction tests (`tests.support.mpi_runs`).

    mpiexec -n N python -m tests.support.mpi_worker tests.support.activation_workers.worker:run OUT

Trains every run of `cases.RUNS[N]` in fp64 with ``build_run``/``train_step`` and records the
losses and this rank's parameters; then builds `cases.BIG` at every layout of
`cases.CONSTRUCTION[N]` with `trainer.construction.build_rank_model`, recording the shards and
the largest tensor allocated while building (a dispatch mode sees every allocation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.support.activation_workers.cases import BIG, BIG_SEED, CONSTRUCTION, RUNS, STEPS, Run
from tests.support.numerics import float64
from trainer.comm.bootstrap import World, init
from trainer.comm.mesh import Mesh
from trainer.comm.topology import MeshShape
from trainer.construction import build_rank_model
from trainer.data.corpus import load_corpus
from trainer.parallel.pipeline.partition import StageLayout, stage_counts
from trainer.parallel.tensor import shard_spec
from trainer.training.run import build_run, mesh_for
from trainer.training.step import train_step


def train_run(world: World, run: Run, out: Path) -> dict[str, Any]:
    cfg = run.config(str(out / run.name))
    corpus = load_corpus(cfg.data.path, cap_bytes=int(cfg.data.data_cap_mb * 2**20))
    state = build_run(cfg, mesh_for(cfg, world), corpus)
    losses = [train_step(state, step).loss for step in range(1, STEPS + 1)]
    return {"losses": losses,
            "params": {n: p.detach().clone() for n, p in state.model.named_parameters()}}


class LargestAllocation(TorchDispatchMode):
    """Records the largest storage (in elements) any op output on a real device has."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.numel = max(self.numel, t.untyped_storage().nbytes() // t.element_size())
        return out


def construct(world: World, tp: int, pp: int) -> dict[str, Any]:
    mesh = Mesh.build(world.comm, MeshShape(dp=world.size // (tp * pp), tp=tp, pp=pp),
                      world.device)
    layout = None
    if pp > 1:
        layout = StageLayout(pp, 1, mesh.rank("pp"), stage_counts(BIG.n_layer, pp, 1))
    with LargestAllocation() as seen:
        model = build_rank_model(BIG, BIG_SEED, device=world.device, layout=layout,
                                 tp=mesh.group("tp"))
    return {"tp_rank": mesh.rank("tp"), "largest_allocation": seen.numel,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "specs": {n: shard_spec(p) for n, p in model.named_parameters()}}


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    with float64():
        result: dict[str, Any] = {r.name: train_run(world, r, out) for r in RUNS[world.size]}
    result["construction"] = {f"tp{tp}pp{pp}": construct(world, tp, pp)
                              for tp, pp in CONSTRUCTION[world.size]}
    return result
