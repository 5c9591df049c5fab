"""Context-parallel attention equals one process's causal attention, with real MPI ranks.

Every rank of ``mpiexec -n N python -m tests.support.mpi_worker
tests.support.cp_workers.attention:run`` (cp 2 and 4) runs ring and all-gather attention on its
zig-zag share of the same fp64 q, k, v and output gradient (`tests.support.cp_workers.cases`),
for multi-head (4/4 heads) and grouped-query (8/2) attention, causal over the window and masked
by documents (``-docs``: some blocks wholly masked, some rows of a block seeing none of its
keys). Here the shares are joined and compared with torch's attention of the unsplit sequence:
output and the gradients of q, k and v. Both sides are fp64 and differ only in the order of
their sums and in the blocks the softmax is merged from, so they agree within
`tests.support.numerics.attention_atol` (~1e-12 here, derived from the reduction counts; a wrong
mask, a lost block or a misrouted gradient moves them by ~1e-1).

Also: the traffic each exchange sends (ring: cp - 1 K/V hops forward, cp - 1 K/V and cp dK/dV
hops backward; all-gather: one gather forward, a gather and a reduce-scatter backward), each
rank's positions, and the gather of a sequence back onto every rank.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.cp_workers.cases import (
    CASES,
    HEADS,
    SCALE,
    WORKER,
    T,
    attention_tensors,
    serial,
)
from tests.support.mpi_runs import world_run
from tests.support.numerics import attention_atol
from trainer.parallel.context import EXCHANGES, SequenceLayout

CP_SIZES = [2, 4]


@pytest.fixture(scope="module", params=CP_SIZES, ids=lambda n: f"cp{n}")
def ranks(request: pytest.FixtureRequest) -> list[dict]:
    return world_run(WORKER, request.param).ranks


def joined(ranks: list[dict], key: str, name: str) -> torch.Tensor:
    return SequenceLayout(T, len(ranks)).join([r[key][name] for r in ranks], dim=2)


@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("case", CASES)
def test_output_and_gradients_equal_full_causal_attention_of_the_unsplit_sequence(
        ranks: list[dict], case: str, exchange: str) -> None:
    whole, want = attention_tensors(case), serial(case)
    tolerance = attention_atol(whole["q"], whole["k"], whole["v"], whole["dout"],
                               blocks=2 * len(ranks), scale=SCALE)
    for name in ("out", "dq", "dk", "dv"):
        torch.testing.assert_close(joined(ranks, f"{case}/{exchange}", name), want[name],
                                   rtol=0, atol=tolerance[name], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("case", HEADS)
def test_ring_passes_kv_cp_minus_one_hops_forward_and_kv_and_its_gradient_backward(
        ranks: list[dict], case: str) -> None:
    cp = len(ranks)
    for rank in ranks:
        got, kv = rank[f"{case}/ring"]["traffic"], 2 * rank[f"{case}/ring"]["kv_numel"]
        # each hop posts one block out and one in; the counter adds up their elements
        assert got[("forward", "batch_p2p")] == (cp - 1, 2 * kv * (cp - 1))
        assert got[("backward", "batch_p2p")] == (2 * cp - 1, 2 * kv * (2 * cp - 1))
        assert {op for _, op in got} == {"batch_p2p"}


@pytest.mark.parametrize("case", HEADS)
def test_allgather_gathers_kv_once_forward_and_again_with_a_reduce_scatter_backward(
        ranks: list[dict], case: str) -> None:
    cp = len(ranks)
    for rank in ranks:
        got, kv_bytes = rank[f"{case}/allgather"]["traffic"], 2 * rank[f"{case}/allgather"][
            "kv_numel"] * 8
        assert got[("forward", "all_gather")] == (1, kv_bytes)
        assert got[("backward", "all_gather")] == (1, kv_bytes)
        assert got[("backward", "reduce_scatter")] == (1, cp * kv_bytes)
        assert ("forward", "batch_p2p") not in got


def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r_at_their_global_positions(
        ranks: list[dict]) -> None:
    cp, chunk = len(ranks), T // (2 * len(ranks))
    for r, rank in enumerate(ranks):
        first, last = r * chunk, (2 * cp - 1 - r) * chunk
        assert rank["positions"].tolist() == [*range(first, first + chunk),
                                              *range(last, last + chunk)]


def test_gather_sequence_puts_the_whole_output_on_every_rank(ranks: list[dict]) -> None:
    for case in CASES:
        for exchange in EXCHANGES:
            whole = joined(ranks, f"{case}/{exchange}", "out")
            for rank in ranks:
                assert torch.equal(rank[f"{case}/{exchange}"]["gathered"], whole)
