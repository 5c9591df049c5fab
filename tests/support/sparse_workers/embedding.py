"""Every lookup case and every sparse optimizer on one rank of a G-rank world.

    mpiexec -n 3 python -m tests.support.mpi_worker tests.support.sparse_workers.embedding:run OUT

Tables are fp64 so the serial comparison sees only summation-order rounding. For each lookup
case the rank returns its pooled output and the gradient rows its shard received (as global
keys); for each optimizer, its shard after `OPT_STEPS` steps; and the plan of the one-owner
case (what it sent and received).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.sparse_workers.cases import (
    DIM,
    HASH_CAPACITY,
    INIT_SCALE,
    LOOKUP_CASES,
    LR,
    NUM_ROWS,
    OPT_STEPS,
    SEED,
    bags,
    cotangent,
    hash_pool,
)
from trainer.comm.bootstrap import init
from trainer.sparse import KINDS, ShardedEmbedding, SparseOptimizer


def _table(comm: Any, hashed: bool) -> ShardedEmbedding:
    size = {"capacity": HASH_CAPACITY} if hashed else {"num_rows": NUM_ROWS}
    return ShardedEmbedding(comm, dim=DIM, seed=SEED, init_scale=INIT_SCALE, dtype=torch.float64,
                            **size)


def _global_keys(table: ShardedEmbedding, rows: torch.Tensor) -> torch.Tensor:
    if table.index is not None:
        return table.index.slot_keys[rows]
    return table.comm.rank + table.comm.size * rows


def lookup_case(comm: Any, case: str) -> dict[str, Any]:
    table = _table(comm, case == "hash")
    b = bags(case, comm.rank, comm.size)
    pooled = table(b.keys, b.offsets, combiner=b.combiner)
    (pooled * cotangent(case, comm.rank, len(b.offsets))).sum().backward()
    rows = table.grad_rows if table.grad_rows is not None else torch.zeros(0, dtype=torch.int64)
    values = table.grad_values if table.grad_values is not None else torch.zeros(0, DIM)
    got = {"out": pooled.detach(), "grad_keys": _global_keys(table, rows), "grad": values,
           "sent": table.last.routing.splits, "received": table.last.recv_splits}
    if case == "hash":
        table.eval()  # get-only: a key never inserted reads as zeros, and is not inserted
        held = table.index.size
        unseen = hash_pool().max() + 1
        got["eval_unseen"] = table.lookup(torch.tensor([unseen] * (comm.rank + 1))).detach()
        got["eval_inserted"] = table.index.size - held
    return got


def optimizer_case(comm: Any, kind: str) -> torch.Tensor:
    table = _table(comm, False)
    opt = SparseOptimizer([table], kind=kind, lr=LR)
    for step in range(OPT_STEPS):
        opt.zero_grad()
        b = bags("opt", comm.rank, comm.size, step)
        pooled = table(b.keys, b.offsets, combiner=b.combiner)
        (pooled * cotangent("opt", comm.rank, len(b.offsets), step)).sum().backward()
        opt.step()
    return table.weight.clone()


def run(out: Path) -> dict[str, Any]:
    comm = init(backend="mpi").comm
    result: dict[str, Any] = {case: lookup_case(comm, case) for case in LOOKUP_CASES}
    result["opt"] = {kind: optimizer_case(comm, kind) for kind in KINDS}
    return result
