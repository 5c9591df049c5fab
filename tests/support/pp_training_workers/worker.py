"""One rank of the PP training tests; returns what it saw (`tests.support.mpi_runs`).

    mpiexec -n N python -m tests.support.mpi_worker tests.support.pp_training_workers.worker:run OUT

For every case of `CASES[N]` it trains with the trainer's own ``build_run``/``train_step`` (the
code ``python -m trainer.train`` runs) and records the losses, gradient norms, this rank's
parameters re-assembled over TP, and its coordinates. For `CHECKPOINT_CASE[N]` it then runs
``trainer.train.train`` twice, to step 2 with a checkpoint and resumed to the end, and resumes
that checkpoint once more with pp = 1, for one step. Any unexpected
exception aborts every rank, so the test sees a failure instead of a hang.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.numerics import float64
from tests.support.pp_training_workers.cases import CASES, CHECKPOINT_CASE, STEPS, Case, case
from trainer.comm.bootstrap import World, init
from trainer.config.options import resolve_dp
from trainer.parallel.tensor import full_state
from trainer.train import train
from trainer.training.run import build_run, mesh_for
from trainer.training.step import train_step


def train_case(world: World, c: Case, out: Path) -> dict[str, Any]:
    cfg = resolve_dp(c.config(run_dir=str(out / c.name)), world.size)
    mesh = mesh_for(cfg, world)
    run = build_run(cfg, mesh)
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        rec = train_step(run, step)
        losses.append(rec.loss)
        norms.append(rec.grad_norm)
    return {"coords": (mesh.rank("tp"), mesh.rank("dp"), mesh.rank("pp")),
            "losses": losses, "norms": norms, "params": full_state(run.model, mesh.group("tp")),
            "local": {n: t.detach().clone() for n, t in run.model.state_dict().items()},
            "placements": {n: p.placement for n, p in run.model.named_parameters()},
            "in_flight": run.body.last.max_in_flight,
            "tied_group": run.body.embd.size if run.body.embd is not None else 0}


def checkpoint_runs(world: World, c: Case, out: Path) -> dict[str, Any]:
    """Train to step 2 and save, resume to the end, then resume once more at pp = 1."""
    run_dir = str(out / f"ckpt-{c.name}")
    first = train(c.config(run_dir=run_dir, stop_at=2, save_every=1, keep=0), world)
    second = train(c.config(run_dir=run_dir, resume=True, keep=0), world)
    flat = train(c.config(run_dir=run_dir, resume=True, pp=1, dp=0, schedule="1f1b",
                          virtual_stages=1, microbatches=1, steps=STEPS + 1, keep=0), world)
    return {"run_dir": run_dir, "first": first.losses, "second": second.losses,
            "start": second.start_step, "flat": (flat.start_step, flat.losses)}


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    result: dict[str, Any] = {"rank": world.rank}
    with float64():  # as the single-device reference (tests/support/numerics.py)
        for c in CASES[world.size]:
            result[c.name] = train_case(world, c, out)
        name = CHECKPOINT_CASE.get(world.size)
        if name:  # in fp64 too, so it can be compared bit for bit with the run above
            result["checkpoint"] = checkpoint_runs(world, case(name), out)
    return result
