"""Llama blocks split over tensor parallelism compute the serial model's loss and gradients:
key/value heads split over the ranks (2 kv heads at tp 2, 8 at tp 2 and 4) and replicated
(2 kv heads at tp 4, each on two ranks, its weight's gradient summed over the group).

Both sides run in fp64 and differ only in the order of sums (split matmuls, the row layers'
all-reduce, the replicated weight's gradient sum), so the loss agrees to `reduction_rtol` of the
longest sum, and a gradient element, a sum of at most LONGEST_SUM terms, to that bound times the
magnitudes summed; these are taken as at most LONGEST_SUM times the largest gradient element
of the parameter (a wrong shard or a missing sum moves gradients by that element's order, some
10^10 times more).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.llama_workers.tp_layers import CASES
from tests.support.mpi_runs import world_run
from tests.support.numerics import reduction_rtol

LONGEST_SUM = 2 * 64 + 176  # batch x seq_len tokens into a weight gradient, + the MLP width
RTOL = reduction_rtol(LONGEST_SUM)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_split_llama_blocks_give_the_serial_loss_and_gradients(world: int, case: str) -> None:
    ranks = world_run("tests.support.llama_workers.tp_layers:run", world)
    for rank in ranks.ranks:
        got = rank[case]
        assert got["tp_loss"] == pytest.approx(got["loss"], rel=RTOL, abs=0)
        for name, grad in got["grads"].items():
            scale = grad.abs().max().item()
            torch.testing.assert_close(got["tp_grads"][name], grad, rtol=0,
                                       atol=RTOL * scale * LONGEST_SUM, msg=name)
    replicated = CASES[case].kv_heads < world
    assert ranks.ranks[0][case]["kv"] == ("ReplicatedKVLinear" if replicated
                                          else "ColumnParallelLinear")
