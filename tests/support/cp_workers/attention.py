"""One rank of the context-parallel attention tests; returns what it computed.

    mpiexec -n N python -m tests.support.mpi_worker tests.support.cp_workers.attention:run OUT

The N ranks form one cp group. For every case of `tests.support.cp_workers.cases` and both
exchanges,
each rank takes its zig-zag share of the whole sequence's q, k, v and output gradient, runs
`ContextParallelAttention` forward and backward, and returns its output and gradients with the
traffic its group saw (counted per phase); the test joins the shares and compares them with
one process's attention of the unsplit sequence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.cp_workers.cases import CASES, SCALE, T, attention_tensors, documents
from trainer.comm.bootstrap import init
from trainer.parallel.context import (
    EXCHANGES,
    ContextParallelAttention,
    SequenceLayout,
    gather_sequence,
)
from trainer.parallel.tensor.counting import CountingCommunicator


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    cp = CountingCommunicator(world.comm.split(0, world.rank, name="cp"))
    layout = SequenceLayout(T, cp.size)
    result: dict[str, Any] = {"rank": cp.rank, "positions": layout.positions(cp.rank)}
    for case in CASES:
        whole, docs = attention_tensors(case), documents(case)
        for exchange in EXCHANGES:
            q, k, v = (layout.split_tensor(whole[name], cp.rank, 2).requires_grad_(True)
                       for name in "qkv")
            attend = ContextParallelAttention(cp, layout, exchange)
            cp.reset()
            cp.phase = "forward"
            y = attend(q, k, v, docs, scale=SCALE)
            cp.phase = "backward"
            y.backward(layout.split_tensor(whole["dout"], cp.rank, 2))
            result[f"{case}/{exchange}"] = {
                "out": y.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
                "traffic": {key: (c.calls, c.bytes) for key, c in cp.counts.items()},
                "kv_numel": k.numel(),
            }
            cp.phase = "gather"
            result[f"{case}/{exchange}"]["gathered"] = gather_sequence(y, cp, layout, 2)
    return result
