"""DLRM training on one rank of a G-rank world: fp64 steps for the serial comparison, and at
G = 2 a resume and a longer run for the validation AUC.

    mpiexec -n 4 python -m tests.support.mpi_worker tests.support.sparse_workers.dlrm:run OUT
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainer.comm.bootstrap import init
from trainer.recsys.config import RecsysConfig, make_config
from trainer.recsys.train import build, load_log, train

STEPS = 4
#: Tiny: 4 features x 50 keys (200 rows, 50 per rank at G = 4), a batch every G divides.
CFG = make_config(steps=STEPS, global_batch=32, lr=0.05, embedding_lr=0.1, dim=8, bottom="16",
                  top="16", rows=2048, features=4, vocab="50", eval_every=0, seed=11,
                  log_every=100)
#: Hash mode, raw keys: the index (which key holds which row) must resume too.
HASH_CFG = CFG.with_options(hash_capacity=150, optimizer="adam")
AUC_CFG = CFG.with_options(steps=150, global_batch=128, rows=16384, features=6, vocab="300",
                           eval_every=50, optimizer="adagrad", lr=0.05, embedding_lr=0.05)


def fp64_steps(world: Any, optimizer: str) -> dict[str, Any]:
    cfg = CFG.with_options(optimizer=optimizer)
    rows, _ = load_log(cfg).split(cfg.data.val_fraction)
    run = build(cfg, world, rows, dtype=torch.float64)
    losses = [run.step(step)[0] for step in range(1, STEPS + 1)]
    return {"losses": losses, "rows": run.model.table.weight.clone(),
            "dense": {k: v.clone() for k, v in run.model.dense.state_dict().items()}}


def resumed(world: Any, out: Path, cfg: RecsysConfig) -> dict[str, Any]:
    straight = train(cfg.with_options(run_dir=str(out / "straight")), world)
    split_dir = str(out / "split")
    first = train(cfg.with_options(steps=2, run_dir=split_dir), world)
    second = train(cfg.with_options(run_dir=split_dir, resume=True), world)
    shard = f"rank-{world.rank:05d}.safetensors"
    return {"straight": straight.losses, "split": first.losses + second.losses,
            "start": second.start_step,
            "same_files": (out / "straight/checkpoints/step-4" / shard).read_bytes() ==
                          (out / "split/checkpoints/step-4" / shard).read_bytes()}


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    result: dict[str, Any] = {k: fp64_steps(world, k) for k in ("sgd", "adagrad")}
    if world.size == 2:  # resume and AUC once, on a sharded table
        result["resume"] = {"identity": resumed(world, out / "identity", CFG),
                            "hash": resumed(world, out / "hash", HASH_CFG)}
        done = train(AUC_CFG.with_options(run_dir=str(out / "auc")), world)
        result["auc"] = {"evals": done.evals, "ceiling": done.ceiling,
                         "plot": (out / "auc" / "auc.png").is_file()}
    return result
