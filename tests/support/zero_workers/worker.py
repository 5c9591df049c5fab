"""One rank of the ZeRO-1 tests; returns what it saw (`tests.support.mpi_runs`).

    mpiexec -n 4 python -m tests.support.mpi_worker tests.support.zero_workers.worker:run OUT

Every case of `CASES[N]` is trained with the trainer's own ``build_run``/``train_step`` twice,
with ``--zero 0`` and ``--zero 1``, in fp64 (compared with each other and with the fp64
single-process reference, tests/support/numerics.py); the dp-only cases also in fp32 without
clipping,
where two ranks' sums are exact in any order, so zero 0 and zero 1 must agree bit for bit.
On 2 ranks ``trainer.train.train`` runs dp 2 with zero 1 uninterrupted and split at step 2
(bit-exact resume), then the split run's checkpoint is resumed at the same dp (which tensor
files each rank reads), with another model (refused) and with --zero 0. On 4 ranks a dp 2 run on
ranks 0-1 is resumed at dp 4 and a dp 4 run at dp 2. `big` (8 ranks) trains a model over the
per-rank budget with tp 2 x pp 2 x dp 2 x zero 1 with its bytes measured (`held_bytes`).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from tests.support.numerics import float64
from tests.support.saved import saved_state
from tests.support.zero_workers.cases import CASES, RESUME_STEPS, STEPS, case_config, config
from trainer import checkpoint
from trainer.comm.bootstrap import World, init
from trainer.comm.mesh import Mesh
from trainer.comm.protocol import Communicator
from trainer.comm.topology import MeshShape
from trainer.errors import TrainerError
from trainer.parallel.zero import ZeroOptimizer
from trainer.parallel.zero.memory import held_bytes
from trainer.train import train
from trainer.training.checkpointing import save_checkpoint
from trainer.training.run import build_run, mesh_for
from trainer.training.step import train_step


def train_case(world: World, cfg: Any, steps: int = STEPS, *, save: bool = False
               ) -> dict[str, Any]:
    """``steps`` steps of ``cfg``; with ``save`` a checkpoint at the end, read back on rank 0."""
    run = build_run(cfg, mesh_for(cfg, world))
    recs = [train_step(run, step) for step in range(1, steps + 1)]
    held = held_bytes(run.model.parameters(), run.dp.buffer, run.weights.optimizer)
    saved = save_checkpoint(run, steps) if save else None
    name_of = {id(p): n for n, p in run.model.named_parameters()}
    zero = run.weights if isinstance(run.weights, ZeroOptimizer) else None
    order = [name_of[id(p)] for p in itertools.chain(*zero.full_groups)] if zero else []
    return {"losses": [r.loss for r in recs], "norms": [r.grad_norm for r in recs],
            "local": {n: t.detach().clone() for n, t in run.model.state_dict().items()},
            "n_params": sum(p.numel() for p in run.dp.params), "held": held, "order": order,
            "saved": read_saved(saved) if saved is not None and world.rank == 0 else None}


def read_saved(path: Path) -> dict[str, Any]:
    """A checkpoint as stored: its files and their sizes, its index, and every saved tensor
    put together (`tests.support.saved`)."""
    record, meta = checkpoint.read_meta(path)
    return {"files": {n: r.size for n, r in record.items()}, "meta": meta,
            "index": checkpoint.read_index(path, record), "state": saved_state(path)}


def both(world: World, name: str, out: Path, *, save: bool = False, **train: object
         ) -> dict[str, Any]:
    return {z: train_case(world, case_config(world.size, name, zero=z, **train,
                                             run_dir=str(out / f"{name}-{z}")), save=save)
            for z in (0, 1)}


def resume_split(world: World, out: Path) -> dict[str, Any]:
    """dp 2, zero 1, fp32: uninterrupted to RESUME_STEPS, and stopped at 2 then resumed; then
    the split run resumed once more (no steps): at dp 2 (the files each rank reads), with
    another model (refused), and with --zero 0."""
    cfg = case_config(2, "dp2", zero=1, steps=RESUME_STEPS)
    whole = train(cfg.with_options(run_dir=str(out / "whole")), world)
    split = cfg.with_options(run_dir=str(out / "split"))
    first = train(split.with_options(stop_at=2), world)
    second = train(split.with_options(resume=True), world)
    ckpts = [read_saved(r.checkpoint) if world.rank == 0 and r.checkpoint else None
             for r in (whole, second)]
    again = split.with_options(resume=True)
    return {"whole": whole.losses, "first": first.losses, "second": second.losses,
            "start": second.start_step, "run_dirs": [str(out / "whole"), str(out / "split")],
            "states": ckpts, "reads": resumed(again, world.comm, world).restored,
            "zero0": resumed(again.with_options(zero=0), world.comm, world).restored,
            "refused": {"model": refusal(again.with_options(n_layer=3), world),
                        "damaged": damaged(again, world, out / "split")}}


def damaged(cfg: Any, world: World, run_dir: Path) -> dict[str, Any]:
    """Resuming after one byte of rank 1's tensor file changed (rank 0 flips it)."""
    if world.rank == 0:
        path = run_dir / "checkpoints" / f"step-{RESUME_STEPS}" / checkpoint.rank_file(1)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    world.comm.barrier()
    return refusal(cfg, world)


def resumed(cfg: Any, comm: Communicator, world: World) -> Any:
    """The run of ``cfg`` (with --resume) built on ``comm`` as its DP group."""
    return build_run(cfg.with_options(dp=comm.size),
                     Mesh.build(comm, MeshShape(dp=comm.size), world.device))


def refusal(cfg: Any, world: World) -> dict[str, Any]:
    """How resuming ``cfg`` fails: the error's message, and whether this rank reports it."""
    try:
        resumed(cfg, world.comm, world)
    except TrainerError as exc:
        return {"message": str(exc), "report": exc.report, "agreed": exc.agreed}
    return {"message": None}


def phase(cfg: Any, comm: Communicator, world: World, last: int, *, resume: bool
          ) -> dict[str, Any]:
    """Train dp = comm.size ranks (a sub-world) to step ``last``, saving there: the losses and
    what the resume read."""
    run = resumed(cfg.with_options(resume=resume), comm, world)
    losses = [train_step(run, step).loss for step in range(run.restored.step + 1, last + 1)]
    save_checkpoint(run, last)
    return {"losses": losses, "reads": run.restored,
            "placements": [m.placement for m in run.weights.values()]}


def change_dp(world: World, out: Path) -> dict[str, Any]:
    """fp64: dp 2 (ranks 0-1) to step 2, resumed at dp 4; dp 4 to step 2, resumed at dp 2.
    Rank 0 also returns the index of each saved step-2 checkpoint."""
    pair = world.comm.split(int(world.rank >= 2), world.rank, name="pair")
    cfg = case_config(4, "dp4", zero=1, steps=RESUME_STEPS)
    result: dict[str, Any] = {}
    up = cfg.with_options(run_dir=str(out / "2to4"))
    if world.rank < 2:
        phase(up, pair, world, 2, resume=False)
    result["2to4"] = phase(up, world.comm, world, RESUME_STEPS, resume=True)
    down = cfg.with_options(run_dir=str(out / "4to2"))
    phase(down, world.comm, world, 2, resume=False)
    if world.rank < 2:
        result["4to2"] = phase(down, pair, world, RESUME_STEPS, resume=True)
    if world.rank == 0:
        result["saved"] = {change: read_saved(out / change / "checkpoints" / "step-2")
                           for change in ("2to4", "4to2")}
    return result


#: The model of the budget test: its fp32 parameters + Adam state (12 bytes per parameter)
#: exceed BUDGET_BYTES; tp 2 x pp 2 x dp 2 x zero 1 holds 4 + 8/2 bytes of each quarter.
BIG = {"n_layer": 4, "d_model": 128, "n_head": 4, "seq_len": 32}
BUDGET_BYTES = 6 * 2**20
BIG_WORLD = 8


def big(out: Path) -> dict[str, Any]:
    """One rank of the budget test (8 ranks: dp 2 x tp 2 x pp 2, zero 1)."""
    world = init(backend="mpi")
    cfg = config(2, 2, 2, {"n_layer": BIG["n_layer"], "schedule": "1f1b"}, zero=1, steps=2,
                 microbatches=2, bucket_size=100_000, run_dir=str(out / "big"))
    cfg = cfg.with_options(**BIG)
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
    return result
