"""Context parallelism trains to the single-process model (`tests.support.cp_workers.training`): cp
2 and cp 4, the GPT and the Llama (grouped-query attention, 8 query and 2 key/value heads), the
ring and the all-gather exchange; and composed with tp 2 and sequence parallelism, pp 2 (1F1B,
and interleaved with 2 chunks), dp 2 with ZeRO-1, 2 and 3, dp 2 with ep 2 and mixture-of-experts
layers, selective and full recomputation; and with document masking (``-docs``: packed short
documents, ``--document-mask``) at cp 2 and 4 for both families and exchanges, with tp 2 and
sequence parallelism, pp 2, and both recomputations, against the single-process masked model
(which `tests.trainer.test_document_mask` shows equals each document run alone). Five steps of
the trainer's own ``build_run``/``train_step`` in fp64 (the mesh, the loader's zig-zag chunks,
the models' attention, the loss over dp x cp, the gradient norm and clipping) on the same global
batches.

A layout differs from the serial run in the order of its sums (the gradients over dp x cp, the
split matmuls) and in attention split into blocks merged with the log-sum-exp rule. The
tolerances are tests/support/numerics.py's fp64 bounds: the longest gradient sum has every
token of the step and the hidden width in it, and a query row's softmax is merged from at most
2 cp + 1 blocks, each merge rounding an exp/log of the log-sum-exp's size (Λ = max score + log
T, at most 8 here: scores are O(1) at 0.02 init) on both sides: 2(2cp + 4)(1 + Λ) more terms.
A missing reduction over cp, a rotary table at local positions or a wrong mask moves the loss
by 1e-4 or more (the first of those bugs did, by 2e-5 on step 1).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.cp_workers.training import (
    DENSE,
    DOCS,
    FAMILIES,
    GLOBAL_BATCH,
    RUNS,
    SEQ_LEN,
    STEPS,
    TRAIN,
    WORKER,
    Run,
)
from tests.support.mpi_runs import world_run
from tests.support.numerics import f64, reduction_rtol
from tests.support.serial_reference import Bounds, bounds
from trainer.config.options import make_config
from trainer.parallel.tensor import shard_tensor

TIED = {"head.weight": "tok_emb.weight"}
"""The GPT's head is its embedding; the last pipeline stage holds a copy under its own name."""
MAX_CP = 4
LAMBDA = 8
HIDDEN = max(make_config(TRAIN, model).gpt.hidden for model in FAMILIES.values())
TOKENS = GLOBAL_BATCH * SEQ_LEN + HIDDEN + 2 * (2 * MAX_CP + 4) * (1 + LAMBDA)
RTOL = reduction_rtol(TOKENS)
LAYOUTS = [(world, run) for world, runs in RUNS.items() if world > 1 for run in runs]


def tolerances(serial: str) -> Bounds:
    """The bounds of the single-process run ``serial``, from its measured gradient scale."""
    ref = world_run(WORKER, 1).ranks[0]
    return bounds({"params": ref[serial]["params"], "grad_scale": ref[f"{serial}/grad_scale"]},
                  steps=STEPS, lr=TRAIN["lr"], n_terms=TOKENS)


def assert_same_run(got: dict, want: dict, name: str, tol: Bounds) -> None:
    """Losses, gradient norms (before clipping) and this rank's slice of every parameter."""
    torch.testing.assert_close(f64(got["losses"]), f64(want["losses"]), rtol=RTOL,
                               atol=tol.loss, msg=f"{name}: losses")
    torch.testing.assert_close(f64(got["norms"]), f64(want["norms"]), rtol=RTOL,
                               atol=tol.norm, msg=f"{name}: gradient norms")
    for param, value in got["params"].items():
        expected = want["params"][TIED.get(param, param) if param not in want["params"]
                                   else param]
        spec = got["specs"][param]
        if spec is not None:
            expected = shard_tensor(expected, got["tp_rank"], got["tp"], spec)
        torch.testing.assert_close(value, expected, rtol=0, atol=tol.params,
                                   msg=f"{name}: {param}")


@pytest.mark.parametrize(("world", "run"), LAYOUTS, ids=[run.name for _, run in LAYOUTS])
def test_the_context_parallel_layout_trains_to_the_single_process_model(world: int,
                                                                        run: Run) -> None:
    serial = world_run(WORKER, 1).ranks[0][run.serial]
    tol = tolerances(run.serial)
    for rank in world_run(WORKER, world).ranks:
        assert_same_run(rank[run.name], serial, run.name, tol)


@pytest.mark.parametrize(("cp", "family", "docs"),
                         [(cp, f, d) for cp in (2, 4) for f in DENSE for d in DOCS])
def test_the_ring_and_the_all_gather_train_the_same_model(cp: int, family: str,
                                                          docs: str) -> None:
    tol = tolerances(f"serial-{family}{docs}")
    for rank in world_run(WORKER, cp).ranks:
        assert_same_run(rank[f"cp{cp}-{family}-allgather{docs}"],
                        rank[f"cp{cp}-{family}-ring{docs}"],
                        f"cp {cp} {family}{docs}: all-gather vs ring", tol)


def test_the_document_mask_changes_the_training_on_the_same_data() -> None:
    """The single-process masked run and the same run causal over the whole window part from
    the first step (by far more than rounding), so a layout that dropped the mask anywhere
    could not match the masked reference."""
    ranks = world_run(WORKER, 1).ranks[0]
    for family in DENSE:
        masked, causal = (f64(ranks[f"serial-{family}{d}"]["losses"]) for d in ("-docs",
                                                                                 "-packed"))
        assert float((masked - causal).abs().min()) > 1e3 * tolerances(f"serial-{family}-docs"
                                                                       ).loss, family
