"""One rank of the ZeRO-1 tests; returns what it saw (`tests.mpi_runs`).

    mpiexec -n 4 python -m tests.mpi_worker tests.zero_workers.worker:run OUT

Every case of `CASES[N]` is trained with the trainer's own ``build_run``/``train_step`` twice,
with ``--zero 0`` and ``--zero 1``, in fp64 (compared with each other and with the fp64
single-process reference, tests/numerics.py); the dp-only cases also in fp32 without clipping,
where two ranks' sums are exact in any order, so zero 0 and zero 1 must agree bit for bit.
On 2 ranks ``trainer.train.train`` runs dp 2 with zero 1 uninterrupted and split at step 2
(bit-exact resume). On 4 ranks a dp 2 run on ranks 0-1 is resumed at dp 4 and a dp 4 run at dp
2, and a model trains with tp 2 x dp 2 x zero 1 with its bytes measured (`held_bytes`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tests.numerics import float64
from tests.zero_workers.cases import CASES, RESUME_STEPS, STEPS, case_config, config
from trainer import checkpoint
from trainer.comm.bootstrap import World, build_groups, init
from trainer.comm.protocol import Communicator
from trainer.comm.topology import ParallelDims
from trainer.train import save_checkpoint, train
from trainer.training.run import build_run
from trainer.training.step import train_step
from trainer.zero.memory import held_bytes


def train_case(world: World, cfg: Any, steps: int = STEPS, *, save: bool = False
               ) -> dict[str, Any]:
    """``steps`` steps of ``cfg``; with ``save`` a checkpoint at the end, read back on rank 0."""
    groups = build_groups(world, ParallelDims(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp))
    run = build_run(cfg, rank=world.rank, dp_comm=groups.dp, device=world.device,
                    groups=groups, world_comm=world.comm)
    recs = [train_step(run, step) for step in range(1, steps + 1)]
    held = held_bytes(run.model.parameters(), run.dp.buffer, run.optimizer)
    saved = save_checkpoint(run, steps) if save else None
    ckpt = checkpoint.load(saved) if saved is not None and world.rank == 0 else None
    return {"losses": [r.loss for r in recs], "norms": [r.grad_norm for r in recs],
            "local": {n: t.detach().clone() for n, t in run.model.state_dict().items()},
            "n_params": sum(p.numel() for p in run.dp.params), "held": held,
            "saved": (ckpt.model, ckpt.optim) if ckpt is not None else None}


def both(world: World, name: str, out: Path, *, save: bool = False, **train: object
         ) -> dict[str, Any]:
    return {z: train_case(world, case_config(world.size, name, zero=z, **train,
                                             run_dir=str(out / f"{name}-{z}")), save=save)
            for z in (0, 1)}


def resume_split(world: World, out: Path) -> dict[str, Any]:
    """dp 2, zero 1, fp32: uninterrupted to RESUME_STEPS, and stopped at 2 then resumed."""
    cfg = case_config(2, "dp2", zero=1, steps=RESUME_STEPS)
    whole = train(replace(cfg, run_dir=str(out / "whole")), world)
    split = replace(cfg, run_dir=str(out / "split"))
    first = train(replace(split, stop_at=2), world)
    second = train(replace(split, resume=True), world)
    ckpts = [checkpoint.load(r.checkpoint) if world.rank == 0 else None
             for r in (whole, second)]
    return {"whole": whole.losses, "first": first.losses, "second": second.losses,
            "start": second.start_step, "run_dirs": [str(out / "whole"), str(out / "split")],
            "states": [(c.model, c.optim) if c else None for c in ckpts]}


def phase(cfg: Any, comm: Communicator, world: World, last: int, *, resume: bool
          ) -> list[float]:
    """Train dp = comm.size ranks (a sub-world) to step ``last``, saving there."""
    cfg = replace(cfg, dp=comm.size, resume=resume)
    run = build_run(cfg, rank=comm.rank, dp_comm=comm, device=world.device)
    losses = [train_step(run, step).loss for step in range(run.start_step + 1, last + 1)]
    save_checkpoint(run, last)
    return losses


def change_dp(world: World, out: Path) -> dict[str, Any]:
    """fp64: dp 2 (ranks 0-1) to step 2, resumed at dp 4; dp 4 to step 2, resumed at dp 2."""
    pair = world.comm.split(int(world.rank >= 2), world.rank, name="pair")
    cfg = case_config(4, "dp4", zero=1, steps=RESUME_STEPS)
    result: dict[str, Any] = {}
    up = replace(cfg, run_dir=str(out / "2to4"))
    if world.rank < 2:
        phase(up, pair, world, 2, resume=False)
    result["2to4"] = phase(up, world.comm, world, RESUME_STEPS, resume=True)
    down = replace(cfg, run_dir=str(out / "4to2"))
    phase(down, world.comm, world, 2, resume=False)
    if world.rank < 2:
        result["4to2"] = phase(down, pair, world, RESUME_STEPS, resume=True)
    return result


#: The model of the budget test: its fp32 parameters + Adam state (12 bytes per parameter)
#: exceed BUDGET_BYTES; tp 2 x dp 2 x zero 1 holds 4 + 8/2 bytes of each half.
BIG = {"n_layer": 4, "d_model": 128, "n_head": 4, "seq_len": 32}
BUDGET_BYTES = 6 * 2**20


def big(world: World, out: Path) -> dict[str, Any]:
    cfg = config(2, 2, 1, {"n_layer": BIG["n_layer"]}, zero=1, steps=2, microbatches=1,
                 bucket_size=100_000, run_dir=str(out / "big"))
    cfg = replace(cfg, gpt=replace(cfg.gpt, **BIG))
    return train_case(world, cfg, steps=2)


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    result: dict[str, Any] = {"rank": world.rank}
    with float64():
        for name, *_ in CASES[world.size]:
            result[name] = both(world, name, out)
        if world.size == 4:
            result["change_dp"] = change_dp(world, out)
    for name, *_ in CASES[world.size]:
        if world.size == 2:  # fp32, no clipping: sums of two are exact (zero 0 == zero 1)
            result[name + "-fp32"] = both(world, name, out / "fp32", grad_clip=0.0, save=True)
    if world.size == 2:  # the same under bf16: fp32 main weights and moments, bf16 model
        result["dp2-bf16"] = both(world, "dp2", out / "bf16", grad_clip=0.0, save=True,
                                  precision="bf16")
        result["dp2-bf16-wire"] = both(world, "dp2", out / "wire", grad_clip=0.0, save=True,
                                       grad_reduce_dtype="bf16")
        result["resume"] = resume_split(world, out)
    else:
        result["big"] = big(world, out)
    return result
