"""One rank of the padded-vocabulary training tests; returns what it saw (`tests.support.mpi_runs`).

    mpiexec -n 4 python -m tests.support.mpi_worker tests.support.padded_vocab_workers.worker:run
    OUT

For every case it builds the run with the trainer's own ``build_run`` (the code
``python -m trainer.train`` runs), records the initial parameters re-assembled over TP, the
loss of a fixed batch through the run's validation forward (the pipeline's stage after stage),
then trains with ``train_step`` and records the losses, gradient norms and final parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.numerics import float64
from tests.support.padded_vocab_workers.cases import CASES, STEPS, VOCAB, Case
from trainer.comm.bootstrap import World, init
from trainer.config.options import resolve_dp
from trainer.parallel.tensor import full_state
from trainer.training.run import build_run, mesh_for
from trainer.training.step import train_step


def eval_batch(micro_batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch every rank and the reference draw alike, with ids all over the vocabulary."""
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, VOCAB, (micro_batch, seq_len), generator=gen) for _ in range(2))
    return x, y


def train_case(world: World, c: Case, out: Path) -> dict[str, Any]:
    cfg = resolve_dp(c.config(run_dir=str(out / c.name)), world.size)
    mesh = mesh_for(cfg, world)
    run = build_run(cfg, mesh)
    tp = mesh.group("tp")
    initial = full_state(run.model, tp)
    run.seeds.reseed(0, run.tracker)  # the streams a forward forks (no dropout: unused)
    run.model.eval()
    with torch.no_grad():
        eval_loss = run.body.eval_loss(*eval_batch(cfg.micro_batch, cfg.gpt.seq_len))
    run.model.train()
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        rec = train_step(run, step)
        losses.append(rec.loss)
        norms.append(rec.grad_norm)
    return {"coords": (mesh.rank("tp"), mesh.rank("dp"), mesh.rank("pp")),
            "rows": cfg.gpt.vocab_rows, "micro_batch": cfg.micro_batch,
            "initial": initial, "params": full_state(run.model, tp),
            "eval_loss": None if eval_loss is None else float(eval_loss),
            "losses": losses, "norms": norms}


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    with float64():  # as the single-process reference (tests/support/numerics.py)
        return {c.name: train_case(world, c, out) for c in CASES}
