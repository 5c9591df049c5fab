"""A Llama with grouped-query attention (8 query heads, 2 key/value heads) trains to the
single-process model's losses and parameters at every layout: dp2 x tp2 x pp2 (1F1B; with
ZeRO-1; with ZeRO-1 and sequence parallelism together; GPipe with selective recomputation),
tp 4 with sequence parallelism (each key/value head replicated on two ranks), tp2 x pp2
interleaved (4 layers, 2 virtual stages) with full recomputation, and mixture-of-experts layers
(SwiGLU experts) at dp2 x tp2 with ep 2.

Every run is three steps of the trainer's own ``build_run``/``train_step`` in fp64 on the same
global batches; layouts differ from the serial run only in the order of sums (DP all-reduce,
split matmuls, the replicated key/value gradient summed over TP, reduce-scatters), so the
tolerances are the fp64 bounds of tests/support/numerics.py. A wrong shard, a missing sum or a lost
microbatch moves parameters by O(lr) = 3e-3.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.support.llama_workers.training import (
    CONSTRUCTED_SEED,
    GLOBAL_BATCH,
    MODEL,
    RUNS,
    STEPS,
    TRAIN,
    WORKER,
    Run,
)
from tests.support.mpi_runs import world_run
from tests.support.numerics import f64, reduction_rtol
from tests.support.serial_reference import Bounds, bounds, train_serially
from trainer.config.options import make_config
from trainer.model.family import build_model
from trainer.parallel.tensor import shard_tensor

CFG = make_config(TRAIN, MODEL).gpt
TOKENS = GLOBAL_BATCH * CFG.seq_len + CFG.hidden  # the longest sum in any element
RTOL = reduction_rtol(TOKENS)
LAYOUTS = [(world, run) for world, runs in RUNS.items() if world > 1 for run in runs]


@functools.cache
def tolerances(serial: str) -> Bounds:
    """The bounds of the single-process run ``serial`` (its gradient scale measured by the
    serial reference of the same model and data)."""
    run = next(r for r in RUNS[1] if r.name == serial)
    ref = train_serially(run.config("unused", 1), STEPS)
    return bounds(ref, steps=STEPS, lr=TRAIN["lr"], n_terms=TOKENS)


@pytest.mark.parametrize(("world", "run"), LAYOUTS, ids=[run.name for _, run in LAYOUTS])
def test_the_layout_trains_to_the_single_process_losses_and_parameters(world: int,
                                                                       run: Run) -> None:
    assert CFG.n_head == 8 and CFG.kv_heads == 2
    serial = world_run(WORKER, 1).ranks[0][run.serial]
    tol = tolerances(run.serial)
    name = run.name
    for rank in world_run(WORKER, world).ranks:
        got = rank[name]
        torch.testing.assert_close(f64(got["losses"]), f64(serial["losses"]), rtol=RTOL,
                                   atol=tol.loss)
        for param, value in got["params"].items():
            want = serial["params"][param]
            spec = got["specs"][param]
            if spec is not None:
                want = shard_tensor(want, got["tp_rank"], got["tp"], spec)
            torch.testing.assert_close(value, want, rtol=0, atol=tol.params,
                                       msg=f"{name}: {param}")


@pytest.mark.parametrize("world", [4, 8])
def test_per_rank_construction_gives_each_rank_its_slice_of_the_serial_init(world: int) -> None:
    """Built on the meta device at tp 4 (key/value weights replicated) and tp 8: every
    parameter equals its slice of the whole model built from the same seed."""
    serial = {n: p.detach() for n, p in build_model(CFG, seed=CONSTRUCTED_SEED).named_parameters()}
    for rank in world_run(WORKER, world).ranks:
        built = rank["constructed"]
        assert built["params"].keys() == serial.keys()
        for name, value in built["params"].items():
            spec = built["specs"][name]
            want = serial[name] if spec is None else shard_tensor(serial[name],
                                                                  built["tp_rank"], world, spec)
            assert torch.equal(value, want), name
