"""DLRM training on sharded embeddings at G = 1, 2, 4 against a serial model, resume, AUC.

The serial model is the same dense tower with one ``nn.EmbeddingBag(sparse=True)`` holding
every row (started from `trainer.sparse.keys.init_rows`, as the shards are) and torch's own
SGD or Adagrad, trained on the whole global batch of each step. Both sides run in fp64 and
differ only by summation order: DP's average of the MLP gradients and the owners' sums of the
row gradients. Each parameter then differs after ``STEPS`` updates by at most
steps · lr · s · reduction_rtol(batch) (s = 1 for SGD; 1/eps for Adagrad, whose g/(√Σg² + eps)
moves by at most 1/eps per unit of g), a per-sample gradient element being at most 1 (as in
`tests.support.numerics`); the losses by that times the number of parameters, plus their own
rounding.
A wrong owner, a lost duplicate or a missing 1/G moves them by the order of lr.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional

from tests.support.mpi_runs import world_run
from tests.support.numerics import reduction_rtol
from tests.support.sparse_workers.dlrm import CFG, STEPS
from trainer.recsys.data import Batches
from trainer.recsys.model import DenseTower, global_keys
from trainer.recsys.train import load_log
from trainer.sparse.keys import init_rows
from trainer.sparse.table import INIT_SCALE

WORLDS = (1, 2, 4)
TARGET = "tests.support.sparse_workers.dlrm:run"
_OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}
_SENSITIVITY = {"sgd": 1.0, "adagrad": 1 / 1e-10}


def _ranks(g: int) -> list[dict[str, Any]]:
    return world_run(TARGET, g).ranks


def _serial(optimizer: str) -> dict[str, Any]:
    cfg = CFG.with_options(optimizer=optimizer)
    model_cfg = cfg.dlrm()
    rows, _ = load_log(cfg).split(cfg.data.val_fraction)
    dense = DenseTower(model_cfg, seed=cfg.seed).to(torch.float64)
    weight = init_rows(torch.arange(sum(model_cfg.vocab)), model_cfg.dim, seed=cfg.seed,
                       scale=INIT_SCALE, dtype=torch.float64)
    table = nn.EmbeddingBag.from_pretrained(weight, freeze=False, mode="sum", sparse=True)
    opts = [_OPTIMIZERS[optimizer](dense.parameters(), lr=cfg.optimizer.lr),
            _OPTIMIZERS[optimizer](table.parameters(), lr=cfg.optimizer.embedding_lr)]
    batches, losses = Batches(rows, cfg.data.global_batch, cfg.seed), []
    for step in range(1, STEPS + 1):
        b = batches.at(step)
        for opt in opts:
            opt.zero_grad()
        embedded = table(global_keys(model_cfg, b.sparse).reshape(-1, 1))
        logits = dense(b.dense.double(), embedded.view(len(b.labels), model_cfg.features, -1))
        loss = functional.binary_cross_entropy_with_logits(logits, b.labels.double())
        loss.backward()
        for opt in opts:
            opt.step()
        losses.append(float(loss.detach()))
    n_params = sum(p.numel() for p in dense.parameters()) + weight.numel()
    return {"losses": losses, "rows": table.weight.detach(), "dense": dense.state_dict(),
            "n_params": n_params}


def _param_atol(optimizer: str) -> float:
    lr = max(CFG.optimizer.lr, CFG.optimizer.embedding_lr)
    return STEPS * lr * _SENSITIVITY[optimizer] * reduction_rtol(CFG.data.global_batch)


@pytest.mark.parametrize("g", WORLDS)
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_dlrm_training_gives_the_serial_models_losses_and_embedding_rows(optimizer: str,
                                                                         g: int) -> None:
    want, ranks = _serial(optimizer), _ranks(g)
    atol = _param_atol(optimizer)
    rows = torch.empty_like(want["rows"])
    for r, rank in enumerate(ranks):
        rows[r::g] = rank[optimizer]["rows"]
        for name, value in rank[optimizer]["dense"].items():
            torch.testing.assert_close(value, want["dense"][name], rtol=0, atol=atol)
        loss_atol = atol * want["n_params"] + reduction_rtol(CFG.data.global_batch)
        assert rank[optimizer]["losses"] == pytest.approx(want["losses"], rel=0, abs=loss_atol)
    torch.testing.assert_close(rows, want["rows"], rtol=0, atol=atol)
    assert not torch.equal(want["rows"], init_rows(torch.arange(len(rows)), CFG.model.dim,
                                                   seed=CFG.seed, scale=INIT_SCALE,
                                                   dtype=torch.float64))


@pytest.mark.parametrize("mode", ["identity", "hash"])
def test_a_resumed_run_continues_bit_exactly(mode: str) -> None:
    for rank in _ranks(2):
        got = rank["resume"][mode]
        assert got["start"] == 2
        assert got["split"] == got["straight"]  # float equality: bit-exact losses
        assert got["same_files"], "the step-4 shards differ between the runs"


def test_validation_auc_rises_well_above_chance_toward_the_planted_models() -> None:
    auc = _ranks(2)[0]["auc"]
    evals, ceiling = auc["evals"], auc["ceiling"]
    first, last = evals[min(evals)], evals[max(evals)]
    print(f"validation AUC {first['val_auc']:.4f} at step {min(evals)} -> "
          f"{last['val_auc']:.4f} at step {max(evals)}; planted model {ceiling:.4f}")
    assert ceiling > 0.8  # the planted structure is learnable at all
    assert last["val_auc"] > 0.7 and last["val_auc"] <= ceiling + 0.02
    assert last["val_loss"] < first["val_loss"] and auc["plot"]
