"""One rank of the tensor-parallel tests; returns what it saw (`tests.support.mpi_runs`).

    mpiexec -n N python -m tests.support.mpi_worker tests.support.tp_workers.worker:run OUT

With N > 1 it first probes the TP layers, the collective counts, dropout streams, recompute,
the refusal of a model that does not split and a sharded checkpoint save that fails on one
writer, all at tp = N. Then it trains every case of `tests.support.tp_workers.cases` at every (tp,
dp)
layout of N ranks (`cases.layouts`), through the trainer's own ``build_run``/``train_step``.
Any exception aborts every rank, so the test sees a failure instead of a hang.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.tp_workers.cases import CKPT_CASE, layouts
from tests.support.tp_workers.layer_probes import (
    all_layer_probes,
    checkpoint_failure_probe,
    count_probe,
    refusal_probe,
)
from tests.support.tp_workers.model_probes import (
    dropout_probe,
    recompute_probe,
    train_all,
    train_case,
)
from trainer.comm.bootstrap import init
from trainer.comm.mesh import Mesh
from trainer.comm.topology import MeshShape


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    result: dict[str, Any] = {"rank": world.rank}
    if world.size > 1:
        tp = Mesh.build(world.comm, MeshShape(tp=world.size), world.device).group("tp")
        result["layers"] = all_layer_probes(tp)
        result["counts"] = count_probe(tp)
        result["dropout"] = dropout_probe(tp)
        result["recompute"] = recompute_probe(tp)
        result["refusal"] = refusal_probe(tp)
        result["checkpoint_failure"] = checkpoint_failure_probe(tp, out)
    for tp_size, dp in layouts(world.size):
        mesh = Mesh.build(world.comm, MeshShape(dp=dp, tp=tp_size), world.device)
        result[f"tp{tp_size}dp{dp}"] = {"tp_rank": mesh.rank("tp"),
                                         **train_all(world, mesh, out)}
    if world.size == 4:  # fp32, as `python -m trainer.train` runs: the resume test's baseline
        mesh = Mesh.build(world.comm, MeshShape(dp=2, tp=2), world.device)
        result["fp32-tp2dp2"] = train_case(CKPT_CASE, world, mesh, out / "fp32")
    return result
