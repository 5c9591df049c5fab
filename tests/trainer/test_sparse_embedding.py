"""The sharded embedding at G = 1..4 against one serial ``nn.EmbeddingBag`` on the same keys.

Each G is one MPI run (`tests.support.sparse_workers.embedding`); the serial table is built here
from
`trainer.sparse.keys.init_rows` of every key (the rows a sharded table starts from) and fed
every rank's bags. Tables are fp64; outputs and gradients may differ only by the order of the
sums (bounded by `tests.support.numerics.reduction_rtol` times the sum of the terms' magnitudes,
which
the serial table computes too, with |cotangent|).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.support.mpi_runs import world_run
from tests.support.numerics import reduction_rtol
from tests.support.sparse_workers.cases import (
    DIM,
    INIT_SCALE,
    LR,
    NUM_ROWS,
    OPT_STEPS,
    SEED,
    bags,
    cotangent,
    hash_pool,
)
from trainer.sparse.keys import init_rows

WORLDS = (1, 2, 3, 4)
TARGET = "tests.support.sparse_workers.embedding:run"


def _ranks(g: int) -> list[dict[str, Any]]:
    return world_run(TARGET, g).ranks


def _serial_keys(case: str) -> torch.Tensor:
    return hash_pool().unique() if case == "hash" else torch.arange(NUM_ROWS)


def _serial(case: str, g: int, *, magnitudes: bool = False) -> tuple[list[torch.Tensor],
                                                                      torch.Tensor]:
    """Every rank's pooled output and the table's gradient (of Σ|x| with ``magnitudes``)."""
    keys = _serial_keys(case)
    weight = init_rows(keys, DIM, seed=SEED, scale=INIT_SCALE, dtype=torch.float64)
    if magnitudes:
        weight = weight.abs()
    index = {int(k): i for i, k in enumerate(keys)}
    outs, loss = [], torch.zeros((), dtype=torch.float64)
    table = None
    for r in range(g):
        b = bags(case, r, g)
        table = table or nn.EmbeddingBag.from_pretrained(weight, freeze=False, mode=b.combiner)
        if len(b.offsets) == 0:
            outs.append(torch.zeros(0, DIM, dtype=torch.float64))
            continue
        idx = torch.tensor([index[int(k)] for k in b.keys], dtype=torch.int64)
        out = table(idx, b.offsets)
        cot = cotangent(case, r, len(b.offsets))
        loss = loss + (out * (cot.abs() if magnitudes else cot)).sum()
        outs.append(out.detach())
    if not loss.requires_grad:  # no rank looked anything up (empty buckets at G = 1)
        return outs, torch.zeros_like(weight)
    loss.backward()
    return outs, table.weight.grad


def _total_keys(case: str, g: int) -> int:
    return sum(len(bags(case, r, g).keys) for r in range(g))


@pytest.mark.parametrize("g", WORLDS)
@pytest.mark.parametrize("case", ["one_hot", "one_owner", "empty_buckets", "duplicates",
                                  "multi_hot_sum", "multi_hot_mean", "hash"])
def test_lookups_and_gradients_equal_one_serial_embedding_bag(case: str, g: int) -> None:
    ranks = _ranks(g)
    outs, grad = _serial(case, g)
    outs_abs, grad_abs = _serial(case, g, magnitudes=True)
    for r in range(g):
        got = ranks[r][case]["out"]
        assert got.shape == outs[r].shape
        torch.testing.assert_close(got, outs[r], rtol=0,
                                   atol=float(reduction_rtol(4) * outs_abs[r].abs().max()) if
                                   len(got) else 0)
    keys = _serial_keys(case)
    position = {int(k): i for i, k in enumerate(keys)}
    seen = torch.zeros(len(keys), dtype=torch.bool)
    n = _total_keys(case, g)
    for r in range(g):
        for key, row in zip(ranks[r][case]["grad_keys"], ranks[r][case]["grad"], strict=True):
            i = position[int(key)]
            assert not seen[i], f"key {int(key)} has two gradient rows"
            assert int(key) % g == r, f"key {int(key)}'s gradient went to rank {r}"
            seen[i] = True
            bound = reduction_rtol(n) * grad_abs[i]
            assert ((row - grad[i]).abs() <= bound).all(), (case, g, int(key), row, grad[i])
    touched = grad_abs.abs().sum(1) > 0
    assert torch.equal(seen, touched), "the gradient rows are not exactly the keys looked up"


@pytest.mark.parametrize("g", WORLDS)
def test_a_batch_owned_by_one_rank_sends_every_key_there(g: int) -> None:
    ranks = _ranks(g)
    for r in range(g):
        sent = ranks[r]["one_owner"]["sent"]
        assert sent[:-1] == [0] * (g - 1) and sent[-1] == len(bags("one_owner", r, g).keys)
    assert ranks[g - 1]["one_owner"]["received"] == [len(bags("one_owner", r, g).keys)
                                                     for r in range(g)]


@pytest.mark.parametrize("g", WORLDS)
def test_evaluation_reads_an_unseen_hash_key_as_zeros_without_inserting_it(g: int) -> None:
    for rank in _ranks(g):
        assert torch.equal(rank["hash"]["eval_unseen"], torch.zeros_like(
            rank["hash"]["eval_unseen"]))
        assert rank["hash"]["eval_inserted"] == 0


def _serial_optimizer(kind: str, g: int) -> torch.Tensor:
    keys = torch.arange(NUM_ROWS)
    weight = init_rows(keys, DIM, seed=SEED, scale=INIT_SCALE, dtype=torch.float64)
    table = nn.EmbeddingBag.from_pretrained(weight, freeze=False, mode="sum", sparse=True)
    opt = {"sgd": lambda p: torch.optim.SGD(p, lr=LR),
           "adagrad": lambda p: torch.optim.Adagrad(p, lr=LR),
           "adam": lambda p: torch.optim.SparseAdam(p, lr=LR)}[kind](list(table.parameters()))
    for step in range(OPT_STEPS):
        opt.zero_grad()
        loss = torch.zeros((), dtype=torch.float64)
        for r in range(g):
            b = bags("opt", r, g, step)
            loss = loss + (table(b.keys, b.offsets) * cotangent("opt", r, len(b.offsets),
                                                                step)).sum()
        loss.backward()
        opt.step()
    return table.weight.detach()


@pytest.mark.parametrize("g", WORLDS)
@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
def test_sparse_optimizers_update_the_rows_as_torch_does_for_a_serial_table(kind: str,
                                                                             g: int) -> None:
    want = _serial_optimizer(kind, g)
    got = torch.empty_like(want)
    for r, rank in enumerate(_ranks(g)):
        got[r::g] = rank["opt"][kind]
    # Gradients differ by summation order only; an update moves by at most lr/eps times that
    # (Adam's and Adagrad's g/(|g| + eps) near 0), eps the smaller of the two rules' (1e-10).
    steps = [[bags("opt", r, g, s) for r in range(g)] for s in range(OPT_STEPS)]
    n = max(sum(len(b.keys) for b in step) for step in steps)
    scale = max(sum(float(cotangent("opt", r, len(b.offsets), s).abs().max())
                    for r, b in enumerate(step)) for s, step in enumerate(steps))
    atol = OPT_STEPS * LR / 1e-10 * reduction_rtol(n) * scale
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    assert not torch.equal(want, init_rows(torch.arange(NUM_ROWS), DIM, seed=SEED,
                                           scale=INIT_SCALE, dtype=torch.float64))
