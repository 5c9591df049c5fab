"""One rank of the mixed-precision tests; returns what it saw (`tests.support.mpi_runs`).

    mpiexec -n 8 python -m tests.support.mpi_worker tests.support.bf16_worker:run OUT

On dp 2 x tp 2 x pp 2 it trains the same tiny model for `STEPS` steps with the trainer's own
``build_run``/``train_step``: in fp32, in bf16, and in bf16 with a bf16 gradient all-reduce. The
fp32 run's losses, gradient norms and learning rates are what the test's tolerance is derived
from (`tests.trainer.test_mixed_precision`). The bf16 run saves a checkpoint at the end and
reports its
fp32 main and bf16 model state. Then ``trainer.train.train`` runs bf16 to step `HALF` with a
checkpoint, resumes to the end, and resumes that checkpoint for one more step in fp32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.comm.bootstrap import World, init
from trainer.config.options import TrainConfig, make_config, resolve_dp
from trainer.train import train
from trainer.training.checkpointing import save_checkpoint
from trainer.training.run import Run, build_run, mesh_for
from trainer.training.step import train_step

STEPS, HALF = 20, 10
GPT = {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16}
TRAIN = {"model": "tiny", "steps": STEPS, "global_batch": 8, "microbatches": 2, "dp": 2,
         "tp": 2, "pp": 2, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2, "seed": 7,
         "data_cap_mb": 0.25, "grad_clip": 1.0, "eval_every": 0, "bucket_size": 4000}


def config(**train: object) -> TrainConfig:
    return make_config({**TRAIN, **train}, GPT)


def train_loop(world: World, cfg: TrainConfig) -> tuple[Run, dict[str, Any]]:
    cfg = resolve_dp(cfg, world.size)
    mesh = mesh_for(cfg, world)
    run = build_run(cfg, mesh)
    out: dict[str, Any] = {"losses": [], "norms": [], "lrs": []}
    for step in range(1, STEPS + 1):
        rec = train_step(run, step)
        out["losses"].append(rec.loss)
        out["norms"].append(rec.grad_norm)
        out["lrs"].append(rec.lr)
    out["coords"] = (mesh.rank("tp"), mesh.rank("dp"), mesh.rank("pp"))
    out["model"] = {n: t.detach().clone() for n, t in run.model.state_dict().items()}
    return run, out


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    result: dict[str, Any] = {"rank": world.rank}
    _, result["fp32"] = train_loop(world, config(precision="fp32",
                                                 run_dir=str(out / "fp32")))
    bf16, result["bf16"] = train_loop(world, config(precision="bf16", run_dir=str(out / "bf16")))
    result["bf16"]["main"] = {n: t.detach().clone() for n, t in bf16.weights.state_dict().items()}
    result["bf16"]["held"] = [(m.detach().clone(), m.placement) for m in bf16.weights.values()]
    result["bf16"]["checkpoint"] = str(save_checkpoint(bf16, STEPS))
    _, result["bf16_reduce"] = train_loop(world, config(
        precision="bf16", grad_reduce_dtype="bf16", run_dir=str(out / "bf16-reduce")))
    resumed = str(out / "bf16-resumed")
    first = train(config(precision="bf16", run_dir=resumed, stop_at=HALF, save_every=5), world)
    second = train(config(precision="bf16", run_dir=resumed, resume=True), world)
    result["resumed"] = {"start": second.start_step, "losses": first.losses + second.losses,
                         "checkpoint": str(second.checkpoint)}
    switched = train(config(precision="fp32", run_dir=resumed, resume=True, steps=STEPS + 1),
                     world)  # the fp32 main weights load into an fp32 model as they are
    result["switched"] = {"start": switched.start_step, "losses": switched.losses}
    return result
